"""The peer for evaluate.py: NVIDIA kvpress presses on the same windows and passkeys.

kvpress pins its own transformers, so this runs in a venv of its own:

    python -m venv /tmp/kvp && /tmp/kvp/bin/pip install torch==2.13.0 kvpress==0.5.5
    /tmp/kvp/bin/python studies/peer_kvpress.py JOB.json RESULT.json  # what --peer kvpress runs

kvpress compresses the prompt's cache once, at the end of prefill (a forward
hook per attention layer); decoding then appends to the compressed
DynamicCache. As in evaluate.py the exact prefill runs once per batch: each
layer's hook inputs are recorded, and every press replays its own hook on a
fresh cache holding the recorded keys and values. The continuation is then
teacher-forced (text) or decoded greedily (passkey) over that cache. KV share =
bytes of the cache's tensors at the end / the same for the uncompressed cache.
"""
from __future__ import annotations

import json
import sys

import torch


def batches(items, most):
    n = -(-len(items) // most)
    size = -(-len(items) // n)
    return [items[i:i + size] for i in range(0, len(items), size)]


@torch.no_grad()
def record(model, prompts):
    """Exact prefill; per layer the hook's (hidden_states, keys, values, kwargs),
    and the last token's logits."""
    from transformers import DynamicCache
    ids = torch.tensor(prompts)
    cache, recorded, hooks = DynamicCache(config=model.config), [], []

    def hook(module, args, kwargs, output):
        layer = cache.layers[module.layer_idx]
        recorded.append((module, kwargs["hidden_states"], layer.keys, layer.values,
                         {k: v for k, v in kwargs.items() if k not in ("hidden_states", "past_key_values")}))

    for layer in model.model.layers:
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        last = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1].float()
    finally:
        for h in hooks:
            h.remove()
    return recorded, last


@torch.no_grad()
def replay(model, recorded, last, press, n, follow=None):
    """Compress a fresh cache with `press` (None: keep all) and decode n tokens."""
    from transformers import DynamicCache
    cache = DynamicCache(config=model.config)
    for module, _, keys, values, _ in recorded:
        cache.update(keys, values, module.layer_idx)
    if press is not None:
        with press(model):  # sets up what the press needs (rotary_emb, ...), as in prefill
            for module, hidden, keys, values, kwargs in recorded:
                press.forward_hook(module, (), dict(kwargs, hidden_states=hidden,
                                                    past_key_values=cache), (None, None))
    B, T = recorded[0][1].shape[:2]
    out = [last]
    for i in range(n - 1):
        token = follow[:, i:i + 1] if follow is not None else out[-1].argmax(-1, keepdim=True)
        pos = torch.full((B, 1), T + i)
        out.append(model(token, past_key_values=cache, position_ids=pos).logits[:, -1].float())
    nbytes = sum(l.keys.nbytes + l.values.nbytes for l in cache.layers)
    return torch.stack(out, dim=1), nbytes


def main(job_path, result_path):
    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM
    transformers.utils.logging.disable_progress_bar()
    job = json.loads(open(job_path).read())
    torch.set_num_threads(job["threads"])
    model = AutoModelForCausalLM.from_pretrained(job["ckpt"], dtype=torch.float32).eval()
    n_new = job["new_tokens"]
    configs = [(None, "full (kvpress)")] + [
        (getattr(kvpress, name)(compression_ratio=r), f"kvpress:{name[:-5]} b={1 - r:g}")
        for name in job["presses"] if hasattr(kvpress, name) for r in job["ratios"]]
    acc = {name: dict(kl=0.0, top1=0.0, nll=0.0, bytes=0, full=0, pk_bytes=0, pk_full=0)
           for _, name in configs}
    failed = {}  # a press that cannot run on these prompts (e.g. shorter than its window)

    def run(press, name, *args):
        if name in failed:
            return None, None
        try:
            return replay(model, *args[:2], press, *args[2:])
        except Exception as e:  # noqa: BLE001 - reported, the others go on
            failed[name] = f"{type(e).__name__}: {e}"
            return None, None

    from tqdm import tqdm
    for chunk in tqdm(batches(job["windows"], job["batch"]), desc="kvpress text batches"):
        follow = torch.tensor([w[-n_new:] for w in chunk])
        recorded, last = record(model, [w[:-n_new] for w in chunk])
        ref = None
        for press, name in tqdm(configs, desc="kvpress configurations", leave=False):
            logits, nbytes = run(press, name, recorded, last, n_new, follow)
            if logits is None:
                continue
            logp = logits.log_softmax(-1)
            ref, full = (logp, nbytes) if ref is None else (ref, full)
            a = acc[name]
            a["kl"] += torch.nn.functional.kl_div(logp, ref, log_target=True,
                                                  reduction="none").sum().item()
            a["top1"] += (logp.argmax(-1) == ref.argmax(-1)).sum().item()
            a["nll"] -= logp.gather(-1, follow[..., None]).sum().item()
            a["bytes"], a["full"] = a["bytes"] + nbytes, a["full"] + full
        del recorded
    # Passkey prompts of one length batch without padding; group them by length.
    by_len = {}
    for i, (ids, _) in enumerate(job["cases"]):
        by_len.setdefault(len(ids), []).append(i)
    answers = {name: [None] * len(job["cases"]) for _, name in configs}
    for idx in by_len.values():
        for chunk in tqdm(batches(idx, job["batch"]), desc="kvpress passkey batches"):
            recorded, last = record(model, [job["cases"][i][0] for i in chunk])
            for press, name in configs:
                logits, nbytes = run(press, name, recorded, last, job["passkey_tokens"])
                if logits is None:
                    continue
                full = nbytes if press is None else full
                for i, ids in zip(chunk, logits.argmax(-1).tolist()):
                    answers[name][i] = ids
                acc[name]["pk_bytes"] += nbytes
                acc[name]["pk_full"] += full
            del recorded
    count = len(job["windows"]) * n_new
    rows = {name: dict(kl=a["kl"] / count, top1=a["top1"] / count,
                       ppl=float(torch.tensor(a["nll"] / count).exp()), share=a["bytes"] / a["full"],
                       pk_share=a["pk_bytes"] / a["pk_full"], pk_tokens=answers[name])
            for name, a in acc.items() if name not in failed}
    info = dict(kvpress=getattr(kvpress, "__version__", None) or _version("kvpress"),
                transformers=transformers.__version__, torch=torch.__version__,
                presses_missing=[p for p in job["presses"] if not hasattr(kvpress, p)],
                failed=failed)
    open(result_path, "w").write(json.dumps(dict(rows=rows, info=info)))


def _version(package):
    from importlib.metadata import version
    return version(package)


if __name__ == "__main__":
    try:
        main(*sys.argv[1:3])
    except Exception:  # noqa: BLE001 - evaluate.py writes why into its report
        import traceback
        open(sys.argv[2], "w").write(json.dumps({"error": traceback.format_exc()}))
