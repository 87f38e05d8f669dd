"""`python -m commweave`: the command-line interface."""

from commweave.cli import app

app(prog_name="commweave")
