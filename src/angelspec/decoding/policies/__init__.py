"""Depth policies: how many drafts each row verifies per step (`base.py`: the protocol, fixed depth, confidence
threshold), D-cut (`dcut.py`), DSpark's Algorithm 1 and production scheduler (`scheduler.py`), their shared
budget maths (`budget.py`), the measured cost table (`costmodel.py`; its profiler is `eval/cost_profile.py`), STS
calibration (`sts.py`), and the `--policy` parser (`factory.py`)."""
