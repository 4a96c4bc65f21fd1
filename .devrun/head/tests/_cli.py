"""Run the `eplb` CLI in process: (exit code, stdout, stderr)."""
from eplb.ops.cli import main


def run_main(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:  # argparse usage errors
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err
