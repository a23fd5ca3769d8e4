"""Random test checkpoints in the real on-disk Hugging Face layouts of the MoE families.

    from localmoe.testing import write_checkpoint
    path = write_checkpoint("kimi_k3", tmp_path, size="tiny", seed=0)

Sizes: `tiny` (tests; writes in well under a second), `small` (~100-300M parameters, for
benchmarks) and `large` (>= 8 GB of expert bytes, for paging beyond RAM); all stream to
disk. `plan_checkpoint` computes names, shapes, shards and byte counts without writing.
Layouts and every tensor name and shape: docs/testing-checkpoints.md.
CLI: `python -m localmoe.testing FAMILY PATH --size tiny|small|large --seed N`.
"""

from localmoe.testing.families import FAMILIES
from localmoe.testing.plan import CheckpointGenerator, Plan, TensorSpec
from localmoe.testing.write import SIZES, plan_checkpoint, write_checkpoint

__all__ = ["FAMILIES", "SIZES", "CheckpointGenerator", "Plan", "TensorSpec", "plan_checkpoint", "write_checkpoint"]
