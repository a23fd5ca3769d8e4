"""Layer kinds, one file each: its `Config`, its tensors' shapes and its construction from weights."""
