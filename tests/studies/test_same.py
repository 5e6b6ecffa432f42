"""studies.same: a record of the 15 configurations, and a comparison that names what differs."""
import copy

import torch

from studies.same import CONFIGS, compare, record


def test_a_record_equals_itself_and_a_change_shows(tiny_ckpt, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 320)
    before = record(str(tmp_path / "a.pt"), str(text), str(tiny_ckpt), new=4, scale=0.05)
    assert set(before) == set(CONFIGS) and len(CONFIGS) == 15
    assert torch.load(tmp_path / "a.pt").keys() == before.keys()
    table = compare(before, before)
    assert "DIFFER" not in table and table.count("| same | same | same |") == 15
    after = copy.deepcopy(before)
    after["h2o 0.5"]["tokens"][0][-1] += 1
    after["default 0.5"]["logits"] += 1e-3
    rows = {row.split(" |")[0].strip("| "): row for row in compare(before, after).splitlines()}
    assert "| DIFFER | same | same |" in rows["h2o 0.5"]
    assert rows["default 0.5"].endswith("| 1.0e-03 |")
