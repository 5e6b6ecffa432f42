"""The kvpress peer's own parts (studies/peer_kvpress.py) that need no kvpress:
bytes of quantized tensors, the replay of one recorded prefill, the two
readings of a long-context case; and how studies/longctx.py scores its answers."""
import pytest
import torch

from studies import evaluate, longctx, peer_kvpress


class Parts:
    """Stands for a quanto tensor: a wrapper whose bytes are its inner tensors'."""

    def __init__(self, **inner):
        self.__dict__.update(inner)

    def __tensor_flatten__(self):
        return list(self.__dict__), None


def test_tensor_bytes_counts_parts_and_floats_at_the_bits_given():
    codes, scale = torch.zeros(10, 32, dtype=torch.uint8), torch.zeros(10, 1)
    q = Parts(_data=Parts(_data=codes), _scale=scale, _shift=scale.clone())
    assert peer_kvpress.tensor_bytes(q) == 320 + 40 + 40
    assert peer_kvpress.tensor_bytes(q, float_bits=16) == 320 + 20 + 20
    assert peer_kvpress.tensor_bytes(torch.zeros(3, 4), float_bits=16) == 24
    assert peer_kvpress.tensor_bytes(torch.zeros(3, 4)) == 48


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    from conftest import save_tiny_hf
    from transformers import AutoModelForCausalLM
    path = save_tiny_hf(tmp_path_factory.mktemp("peer") / "ckpt")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def full_only(model):
    configs = [(None, "full (kvpress)", None)]

    def run(press, name, quant, task, recorded, last, n, follow=None, prompts=None):
        return peer_kvpress.replay(model, recorded, last, press, n, follow, quant)
    return configs, run


def test_replay_teacher_forces_then_decodes_greedily(hf_model):
    """One recorded prefill replayed: the logits of every step equal a plain
    forward pass over the prompt, the forced tokens and the greedy ones."""
    torch.manual_seed(0)
    prompt, forced = torch.randint(0, 256, (2, 9)), torch.randint(0, 256, (2, 3))
    recorded, last = peer_kvpress.record(hf_model, prompt.tolist())
    logits, nbytes = peer_kvpress.replay(hf_model, recorded, last, None, 6, forced)
    ids = torch.cat([prompt, forced], 1)
    for i in range(3, 5):  # after the forced tokens, each step feeds the last greedy choice
        ids = torch.cat([ids, logits[:, i].argmax(-1, keepdim=True)], 1)
    with torch.no_grad():
        want = hf_model(ids).logits[:, prompt.shape[1] - 1:].float()
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
    # 2 layers x K and V x (2, 2 KV heads, 9 + 5 tokens, 16) floats
    assert nbytes == 2 * 2 * (2 * 2 * 14 * 16) * 4


def test_full_cache_answers_the_same_in_both_readings(hf_model):
    """With nothing dropped, feeding the question on top of the context's cache
    answers as prefilling both does; cases of different lengths batch apart."""
    torch.manual_seed(1)
    cases = [dict(context=torch.randint(0, 256, (c,)).tolist(),
                  question=torch.randint(0, 256, (q,)).tolist(), n=n)
             for c, q, n in ((20, 4, 5), (20, 4, 3), (17, 6, 5))]
    job = dict(longctx_cases=cases, readings=["question_last", "agnostic"], batch=8)
    got = peer_kvpress.answer_cases(hf_model, job, *full_only(hf_model))
    ql, ag = (got[rd]["full (kvpress)"] for rd in ("question_last", "agnostic"))
    assert ql["answers"] == ag["answers"] and ql["bytes"] == ql["full_bytes"] > 0
    for case, answer in zip(cases, ql["answers"]):
        ids = case["context"] + case["question"]
        for _ in range(case["n"]):
            with torch.no_grad():
                ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
        assert answer[:case["n"]] == ids[-case["n"]:]


def test_longctx_scores_the_peers_answers(monkeypatch):
    tok = type("Tok", (), dict(eos_ids={0}, decode=lambda self, ids: " ".join(map(str, ids))))()
    cases = [longctx.Case("niah_single", [5], [6], ["12"], 2),
             longctx.Case("niah_single", [5], [6], ["7"], 2)]
    answers = dict(answers=[[12, 13, 14], [8, 0, 7]], bytes=30, full_bytes=100)
    broken = dict(answers=[[12, 13], None], bytes=0, full_bytes=100)
    info = dict(failed={"kvpress:X b=0.5 on agnostic": "why"})
    monkeypatch.setattr(evaluate, "run_peer_job", lambda python, job: dict(
        cases=dict(agnostic={"kvpress:SnapKV b=0.5": answers, "kvpress:X b=0.5": broken}),
        info=info))
    res, got_info = longctx.peer_cases("py", "ckpt", tok, cases, ["agnostic"], [0.5], 4, 1)
    assert got_info == info and list(res["agnostic"]) == ["kvpress:SnapKV b=0.5"]
    r = res["agnostic"]["kvpress:SnapKV b=0.5"]
    # Cut to n_new = 2 tokens and at the end-of-turn token: "12 13" holds 12, "8" not 7.
    assert r["answers"] == ["12 13", "8"] and r["scores"] == [1.0, 0.0]
    monkeypatch.setattr(evaluate, "run_peer_job", lambda python, job: {"error": "no kvpress"})
    assert longctx.peer_cases("py", "ckpt", tok, cases, ["agnostic"], [0.5], 4, 1) == (
        {}, {"error": "no kvpress"})

