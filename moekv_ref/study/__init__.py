"""A study of KV budgets on a task where context matters: recall of values assigned far back.

recall_task.py builds the windows and scores them; train_fast.py runs the one model code through a
fused causal attention (with an optional sliding window), and training.py's loop trains it through
that forward; the program apps/study_pilot.py checks that dense attention learns the task before
any budget is compared on it.
"""
