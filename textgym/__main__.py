import sys

try:
    from textgym.cli import command
except KeyboardInterrupt:  # Ctrl-C while Python imports textgym
    print("\ntextgym: aborted", file=sys.stderr)
    raise SystemExit(130) from None

command()
