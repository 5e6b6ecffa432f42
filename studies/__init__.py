"""Studies of the method (quality, speed, memory, attention), each run as python -m studies.NAME."""
from pathlib import Path

SUFFIXES = (".md", ".json", ".png")


def output(out, suffix: str) -> Path:
    """The file `--out` names with `suffix`: a dot in the name is the name's own (`x_0.25` gives
    `x_0.25.md`, not `x_0.md`), and a suffix of ours given is replaced (`x.md` gives `x.json`)."""
    out = Path(out)
    stem = out.name[:-len(out.suffix)] if out.suffix in SUFFIXES else out.name
    return out.with_name(stem + suffix)
