"""Image input before the vision towers: decoding and checking image files (`images.py`) and each
tower's own preprocessing (resize / pad to its patch grid, normalisation, patches), with Pillow."""
