from starqa.cli import run

run()
