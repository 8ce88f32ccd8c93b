"""`python -m spmdtask.recipe --recipe=FILE.toml` (runner.main)."""
from spmdtask.recipe import runner

runner.main()
