"""`localmoe convert`: a checkpoint (`open_checkpoint`) -> a packed store (docs/convert.md).

`run.py` is the run (order, resume, report), `sources.py` reads the source's tensors as byte
ranges, `experts.py` makes each routed expert's parts. It sits above the families and the store:
nothing below it imports it.
"""

from localmoe.convert.run import ERRORS_JOURNAL, REPORT_FILE, convert

__all__ = ["ERRORS_JOURNAL", "REPORT_FILE", "convert"]
