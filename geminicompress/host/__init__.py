"""The machine a run is on: its CPU threads (threads.py), memory (memory.py), what it is (machine.py), the
output folder on its disk (output.py) and what a disk refusal says (diskerrors.py), and the progress lines a
run reports through (progress.py). Imports nothing above core/."""
