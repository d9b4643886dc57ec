"""Independent float64 NumPy references for the update rules of docs/design.md §2.

They are transcribed line by line from the spec text, not from
``dml_optim.core.functional``, so that the two can disagree.
"""
