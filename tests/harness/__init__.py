"""The test harness: one launcher (launch.py), one quiet Trainer (trainer.py), one model zoo (zoo/), the typed run
descriptions the training workers take (runs.py), and reading what the ranks saved (results.py)."""
