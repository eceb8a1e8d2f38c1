"""`starqa` and `python -m starqa`: a cold ask's head start first (`starqa.coldstart.headstart`:
forked before anything heavy is imported), then the command line."""

import sys


def main() -> None:
    from starqa.coldstart import headstart

    headstart.fork_for(sys.argv[1:])
    from starqa.cli import run

    run()


if __name__ == "__main__":
    main()
