"""What one `--reload` poll costs the master: a stat per watched file and directory.

    python bench/reload_poll.py [--files 5000] [--per-dir 50] [--polls 30]

Writes the files into a temporary directory, builds the Watcher the master would, and
times polls that find nothing changed (the usual case). Prints the median and worst poll,
the share of a core that polling once a second takes, and the interval the watcher then
keeps (it spaces polls out so that they stay under reload.MAX_SHARE of a core).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from forkq import reload  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=5000)
    parser.add_argument("--per-dir", type=int, default=50)
    parser.add_argument("--polls", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="forkq-reload-bench-") as root:
        files = []
        for i in range(args.files):
            d = Path(root) / f"pkg{i // args.per_dir}"
            d.mkdir(exist_ok=True)
            f = d / f"mod{i}.py"
            f.write_text("X = 1\n")
            files.append(str(f))
        watcher = reload.Watcher(files)
        costs = []
        for _ in range(args.polls):
            started = time.perf_counter()
            assert watcher.changed() == []
            costs.append(time.perf_counter() - started)
        median = statistics.median(costs)
        print(f"{len(files)} files in {len(watcher.dirs)} directories: poll median "
              f"{median * 1e3:.1f} ms, worst {max(costs) * 1e3:.1f} ms; "
              f"{median / reload.POLL_S:.1%} of a core at one poll a second; "
              f"interval kept: {watcher.interval:.1f} s")


if __name__ == "__main__":
    main()
