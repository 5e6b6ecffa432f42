"""Attention structure: recovery vs KV compression per threshold T, the policy
mix per layer, and whether the profiled policies still hold while decoding.

    python -m studies.attention_study --threads 1     # default model: 628 s on 2 busy CPU cores
    python -m studies.attention_study --quick --ckpt CKPT --out /tmp/study   # seconds

1. Sweep. Each prompt is prefilled once, through FastGen caches told to keep
   everything (T = 1): their profiling gives every shortlist policy's recovery
   per KV head, and their one group holds the prompt's slots (positions,
   heavy-hitter scores, flags), on which each policy's `keep` counts what it
   would keep. `profiling.choose` then gives each head's policy for every T
   from these same numbers, and the bytes follow from the kept counts and
   pool.py's page layout. On the first `--n-check` prompts the real cache
   runs at every T and must allocate exactly those bytes and make the same
   plan. Bytes are taken at the end of prefill (max_new_tokens=1), so no decode
   capacity is reserved on either side.
2. The policy mix per layer (the paper's figure) at T=0.95, and for every T.
3. Decode check, on `--n-decode` prompts: FastGen (T=0.95) generates greedily
   (EOS does not stop it) while a dense cache is fed the same tokens
   (teacher-forced). At the chosen steps a KV head's recovery is the share of
   the dense model's attention for the new token (averaged over the head's
   query heads) that falls on the tokens the head's compressed cache holds at
   that step (its cache plus the new token, before eviction).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

import generation as gen_
from cache import scored_prompt
from model import KVCache, attend, reserve
from policies import Slots, shortlist, token_flags
from pool import group_pages, page_size
from profiling import attention_sums, choose, local_ratios

THRESHOLDS = (0.85, 0.90, 0.93, 0.95, 0.98)


# --- 1. Sweep ----------------------------------------------------------------

@torch.no_grad()
def profile_prompt(model, prompt, flags, policies):
    """One prefill. Returns recoveries and kept counts, each (L, K, P): for every
    layer, KV head and shortlist policy."""
    T = len(prompt)
    every_head_full = gen_.CacheOptions("fastgen", recovery=1.0, paper=True)
    caches = gen_.make_caches(model, every_head_full, [T], 1, flags)
    model.setup_caches(caches)
    gen_.prefill(model, torch.tensor([prompt]), torch.tensor([T]))
    model.setup_caches(None)
    rec, kept = [], []
    for c in caches:
        (full,) = c.pool.groups  # threshold 1: every head is Full, one group, segments in order
        s = c.slots(full)
        s = Slots(s.pos[:, :T], s.score[:, :T], s.flags[:, :T], s.prompt_len, s.prompt_len)
        rec.append(c.recovery)
        kept.append(torch.stack([p.keep(s).sum(-1) for p in policies], dim=1))
    return torch.stack(rec), torch.stack(kept)


def derive(model, rec, kept, threshold, prompt_len):
    """What the cache does at `threshold`: each head's policy (L, K), its recovery
    and kept tokens (L, K), and the bytes the cache allocates."""
    # pool.py's pool: K and V (D values each), pos int32, score float32, flags
    # uint8 per slot (no latest attention: no shortlist policy reads it); the
    # owner int64 per page; start, width, prompt_len, first_query, evicts_by,
    # drops_by and dest int64 per segment (and no free slots handed out yet).
    a = model.args
    per_slot = 2 * a.head_dim * model.tok_embeddings.weight.element_size() + 4 + 4 + 1
    choice = torch.stack([choose(r, threshold) for r in rec])  # (L, K)
    n_kept = kept.gather(2, choice[..., None])[..., 0]
    nbytes = 0
    page = page_size(prompt_len)
    for l in range(rec.shape[0]):
        for p in choice[l].unique():
            # Heads of one policy holding about as much share a bucket as wide as the fullest.
            sizes = sorted(n_kept[l][choice[l] == p].tolist())
            for g, pages in group_pages(sizes, 0, page):
                nbytes += len(sizes[g]) * (pages * (page * per_slot + 8) + 56)
    return choice, rec.gather(2, choice[..., None])[..., 0], n_kept, nbytes


def sweep(model, prompts, flags, policies, thresholds, n_check):
    """Per T: recoveries of the chosen policies, compression per prompt, kept share,
    policy mix (L, P); and the derived-vs-allocated checks."""
    from tqdm import tqdm
    names = [repr(p) for p in policies]
    acc = {t: dict(rec=[], compression=[], kept=[], mix=0) for t in thresholds}
    checks = []
    for i, prompt in enumerate(tqdm(prompts, desc="sweep")):
        rec, kept = profile_prompt(model, prompt, flags, policies)
        for t, a in acc.items():
            choice, chosen, n_kept, nbytes = derive(model, rec, kept, t, len(prompt))
            a["rec"].append(chosen.flatten())
            a["compression"].append(1 - nbytes / gen_.dense_kv_bytes(model, 1, len(prompt) + 1))
            a["kept"].append(n_kept.sum().item() / (n_kept.numel() * len(prompt)))
            a["mix"] = a["mix"] + torch.nn.functional.one_hot(choice, len(policies)).float()
            if i < n_check:
                g = gen_.generate(model, [prompt], 1, token_flags=flags,
                                  cache=gen_.CacheOptions("fastgen", recovery=t, paper=True))
                checks.append(dict(prompt=i, T=t, derived_bytes=nbytes, allocated_bytes=g.kv_bytes,
                                   derived_kept=int(n_kept.sum()), allocated_kept=g.kept_tokens,
                                   same_plan=g.plan == [[names[p] for p in l] for l in choice.tolist()]))
    summary = {}
    for t, a in acc.items():
        r, c = torch.cat(a["rec"]), torch.tensor(a["compression"])
        summary[t] = dict(recovery_mean=r.mean().item(), recovery_min=r.min().item(),
                          compression_mean=c.mean().item(), compression_min=c.min().item(),
                          compression_max=c.max().item(), kept_share=sum(a["kept"]) / len(prompts),
                          mix=(a["mix"] / len(prompts)).mean(1))  # (L, P) share of KV heads
    ok = all(c["derived_bytes"] == c["allocated_bytes"] and c["derived_kept"] == c["allocated_kept"]
             and c["same_plan"] for c in checks)
    return summary, checks, ok


# --- 3. Decode check -----------------------------------------------------------

class ProbedKVCache(KVCache):
    """The dense cache, also keeping each decode step's attention distribution
    (B, K, S), averaged over the query heads of each KV head."""

    def forward(self, q, k, v, input_pos, tokens):
        y = super().forward(q, k, v, input_pos, tokens)
        if k.shape[2] == 1:
            B, K, _, D = k.shape
            slots = torch.arange(self.v.shape[2], device=q.device)
            visible = (slots[None, :] <= input_pos)[:, None, None, :]
            self.probs = attend(q.view(B, K, -1, D), self.k, self.v, visible)[1].mean(2)
        return y


def held(cache, n_seen: int) -> torch.Tensor:
    """(S, n_seen) bool: the positions a FastGen layer cache holds now."""
    mask = torch.zeros(cache.choice.shape[0], n_seen, dtype=torch.bool)
    for g in cache.pool.groups:
        pos = cache.slots(g).pos
        rows, cols = (pos >= 0).nonzero(as_tuple=True)
        mask[g.seg[rows], pos[rows, cols].long()] = True
    return mask


# Profiling variants whose prompt-time recovery is compared with decode-time recovery:
# (query rows read: None = all, or the last n; whether the first token's mass counts).
VARIANTS = {"all rows, sink counted (paper)": (None, True), "all rows, sink dropped": (None, False),
            "last 32 rows, sink counted": (32, True), "last 32 rows, sink dropped": (32, False)}


def variant_recoveries(cache, q, k, tokens, rows, sink: bool) -> torch.Tensor:
    """(S, P) each shortlist policy's recovery of the prompt's attention, read on
    its last `rows` rows (None: all), with the first token's mass counted or,
    without `sink`, left out of what is recovered and of what is read (every
    shortlist policy keeps that token)."""
    sums = attention_sums(q, k, cache.prompt_lens, local_ratios(cache.policies), rows)
    _, r = scored_prompt(cache, sums, tokens)
    if sink:
        return r
    first, read = sums.colsum[:, :1], sums.rows[:, None]
    return torch.where(read - first > 1e-4 * read, (r * read - first) / (read - first), 1.0)


class Variants(torch.nn.Module):
    """A FastGen layer cache that also profiles its prompt in every variant."""

    def __init__(self, cache):
        super().__init__()
        self.cache = cache

    def forward(self, q, k, v, input_pos, tokens):
        if self.cache.pool is None:  # the prompt: profile it in every variant
            self.recovery = torch.stack([variant_recoveries(self.cache, q, k, tokens, rows, sink)
                                         for rows, sink in VARIANTS.values()])  # (V, S, P)
        return self.cache(q, k, v, input_pos, tokens)


@torch.no_grad()
def decode_check(model, prompt, flags, threshold, steps):
    """Recovery (2, len(steps), L, K) of each head's compressed cache at the given decode
    steps under the dense model's attention, with and without the first token's mass;
    each head's prompt recovery (L, K) and under every profiling variant (V, L, K), and
    its policy index (L, K)."""
    T, n = len(prompt), max(steps)
    a, w = model.args, model.tok_embeddings.weight
    paper = gen_.CacheOptions("fastgen", recovery=threshold, paper=True)
    fast = [Variants(c) for c in gen_.make_caches(model, paper, [T], n + 1, flags)]
    dense = [ProbedKVCache(1, a.n_kv_heads, T + n + 1, a.head_dim, w.dtype) for _ in model.layers]
    for caches in (dense, fast):  # both prefills are exact, so both give the same first token
        model.setup_caches(caches)
        cur = gen_.prefill(model, torch.tensor([prompt]), torch.tensor([T]))
    out = []
    for s in range(1, n + 1):
        pos = torch.tensor([[T + s - 1]])
        if s in steps:  # what the compressed cache attends over at this step
            holds = [held(c.cache, T + s) | (torch.arange(T + s) == T + s - 1) for c in fast]
        model.setup_caches(dense)
        gen_.decode_one_token(model, cur, pos)  # teacher-forced on FastGen's tokens
        model.setup_caches(fast)
        reserve([c.cache for c in fast])
        cur = gen_.decode_one_token(model, cur, pos)
        if s in steps:
            got = torch.stack([(c.probs[0, :, :T + s] * h).sum(-1) for c, h in zip(dense, holds)])
            sink = torch.stack([c.probs[0, :, 0] for c in dense])  # (L, K), always held
            out.append(torch.stack([got, (got - sink) / (1 - sink)]))
    model.setup_caches(None)
    choice = torch.stack([c.cache.choice for c in fast])
    variants = torch.stack([c.recovery.gather(2, c.cache.choice[None, :, None].expand(
        len(VARIANTS), -1, 1))[..., 0] for c in fast], dim=1)  # (V, L, K)
    return torch.stack(out, dim=1), variants[0], variants, choice


def prediction_table(variants, per_step, choice, n_policies, headline):
    """How well each profiling variant's prompt recovery predicts the recovery while
    decoding, on the compressed heads: Pearson r against the mean over the decode
    steps, the mean gap, and the share of heads that profiling passed (>= T) but
    that fall below T while decoding."""
    compressed = choice != n_policies - 1
    rows = []
    for v, (name, (_, sink)) in enumerate(VARIANTS.items()):
        x = variants[v][compressed]
        y = per_step[0 if sink else 1].mean(0)[compressed]  # mean over the decode steps
        r = torch.corrcoef(torch.stack([x, y]))[0, 1].item() if x.numel() > 1 else float("nan")
        passed = x >= headline
        fell = (passed & (y < headline)).float().sum() / passed.float().sum().clamp(min=1)
        rows.append((name, f"{r:.2f}", f"{(x - y).mean():+.3f}", f"{fell:.0%}"))
    return table(["profiling", "r (prompt vs decode)", "mean gap", "passed T, fell below it"], rows)


# --- 2 and 4. Pictures and report ----------------------------------------------

def plot_mix(path, mixes, names, title):
    """Stacked bars: x = layer, y = share of KV heads with each policy; one panel per T."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = min(len(mixes), 3)
    rows = -(-len(mixes) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols + 2.5, 3.4 * rows), squeeze=False,
                             layout="constrained")
    colors = plt.get_cmap("viridis")(torch.linspace(0, 1, len(names)).tolist())
    for ax, (t, mix) in zip(axes.flat, mixes.items()):
        bottom = torch.zeros(mix.shape[0])
        for p, name in enumerate(names):
            ax.bar(range(mix.shape[0]), mix[:, p], bottom=bottom, width=0.85, color=colors[p], label=name)
            bottom += mix[:, p]
        ax.set(title=f"T = {t}", xlabel="layer", ylabel="share of KV heads", ylim=(0, 1))
        ax.xaxis.get_major_locator().set_params(integer=True)
    for ax in axes.flat[len(mixes):]:
        ax.axis("off")
    axes[0][-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        cpu = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (f"{cpu}, {os.cpu_count()} cores (load average {load} at the end), "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}")


def table(header, rows) -> str:
    cell = lambda x: str(x).replace("|", "\\|")  # a policy union's | would split the cell
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, r)) + " |" for r in rows])


def spread(x: torch.Tensor) -> str:
    return "-" if not x.numel() else f"{x.mean():.3f} ± {x.std():.3f}" if x.numel() > 1 else f"{x.mean():.3f}"


def main(ckpt=None, out="results/attention_study", quick=False, n_prompts=30, min_tokens=512,
         max_tokens=2048, thresholds=THRESHOLDS, headline=0.95, n_check=3, n_decode=5,
         steps=(1, 10, 50, 100), seed=0, command="") -> dict:
    """Run the study; write attention_study.{md,json} and the PNGs to `out`."""
    from tqdm import tqdm
    from model import load_model
    from studies.textdata import prompts as text_prompts
    from tokenizer import Tokenizer
    if quick:
        # A random tiny model attends almost uniformly: low thresholds, so that
        # some heads are compressed and the checks have something to check.
        n_prompts, min_tokens, max_tokens, thresholds, headline = 3, 24, 48, (0.5, 0.9), 0.9
        n_check, n_decode, steps = 3, 2, (1, 3)
    from convert_gguf import checkpoint_folder
    ckpt = checkpoint_folder(ckpt)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    model, tok = load_model(ckpt), Tokenizer(ckpt)
    V = model.args.vocab_size
    flags = token_flags(V, [i for i in tok.special_ids if i < V], [i for i in tok.punctuation_ids() if i < V])
    policies = shortlist()
    names = [repr(p) for p in policies]
    prompts = text_prompts(tok, n_prompts, min_tokens, max_tokens, seed)
    lens = [len(p) for p in prompts]

    summary, checks, checks_ok = sweep(model, prompts, flags, policies, thresholds, n_check)
    title = f"{Path(ckpt).name}: policy of each KV head, mean over {len(prompts)} prompts"
    plot_mix(out / "policy_mix.png", {headline: summary[headline]["mix"]}, names, title)
    plot_mix(out / "policy_mix_all_T.png", {t: s["mix"] for t, s in summary.items()}, names, title)

    decode_prompts = prompts[::max(1, len(prompts) // n_decode)][:n_decode]
    runs = [decode_check(model, p, flags, headline, steps) for p in tqdm(decode_prompts, desc="decode check")]
    per_step = torch.stack([r[0] for r in runs], dim=2)  # (2, steps, prompts, L, K)
    prompt_rec, choice = torch.stack([r[1] for r in runs]), torch.stack([r[3] for r in runs])
    variants = torch.stack([r[2] for r in runs], dim=1)  # (V, prompts, L, K)
    predict_table = prediction_table(variants, per_step, choice, len(policies),
                                     headline)
    per_step = per_step[0]  # with the sink counted, as the paper measures
    runtime = time.perf_counter() - t_start

    sweep_table = table(
        ["T", "mean recovery", "min recovery", "KV bytes saved: mean (min, max)", "kept/seen tokens"],
        [(t, f"{s['recovery_mean']:.3f}", f"{s['recovery_min']:.3f}",
          f"{s['compression_mean']:.1%} ({s['compression_min']:.1%}, {s['compression_max']:.1%})",
          f"{s['kept_share']:.1%}") for t, s in summary.items()])
    mix_table = table(["T", *names], [(t, *(f"{x:.1%}" for x in s["mix"].mean(0).tolist()))
                                      for t, s in summary.items()])
    check_table = table(["prompt", "T", "derived bytes", "allocated bytes", "derived kept",
                         "allocated kept", "same plan"], [tuple(c.values()) for c in checks])
    compressed = choice != len(policies) - 1
    rows = [("prompt (profiling)", prompt_rec)] + [(f"decode step {s}", per_step[i]) for i, s in enumerate(steps)]
    used = [p for p in range(len(policies) - 1) if (choice == p).any()]
    decode_table = table(
        ["", "compressed heads: mean ± std", "10th pct", f"share < {headline}", "all heads: mean",
         *(f"{names[p]} ({int((choice == p).sum())})" for p in used)],
        [(label, spread(x[compressed]), f"{x[compressed].quantile(0.1):.3f}" if compressed.any() else "-",
          f"{(x[compressed] < headline).float().mean():.0%}" if compressed.any() else "-",
          f"{x.mean():.3f}", *(spread(x[choice == p]) for p in used)) for label, x in rows])
    report = f"""# Attention structure: recovery vs KV compression

Model `{Path(ckpt).name}` ({model.args.n_layers} layers, {model.args.n_kv_heads} KV heads), float32, batch 1;
{len(prompts)} prompts of {min(lens)} to {max(lens)} tokens cut from Python's documentation topics
(`studies/textdata.py`). Machine: {machine()}. Date: {time.strftime('%Y-%m-%d %H:%M')}. Runtime {runtime:.0f} s.
Command: `{command or 'attention_study.main(...)'}`

## Recovery vs compression per threshold T

Recovery: share of the prompt's attention that each KV head's chosen policy keeps (mean and
min over prompts x layers x KV heads). KV bytes saved: 1 - allocated / full cache, at the end of
prefill, per prompt. All thresholds come from one profiling pass per prompt.

{sweep_table}

Share of KV heads per policy (all layers):

{mix_table}

Derived vs really allocated (the real FastGen cache at each T on the first {n_check} prompts):
**{'all equal' if checks_ok else 'MISMATCH'}**.

{check_table}

Policy mix per layer: `policy_mix.png` (T = {headline}) and `policy_mix_all_T.png`.

## Recovery while decoding (T = {headline})

{len(decode_prompts)} prompts ({', '.join(str(len(p)) for p in decode_prompts)} tokens); FastGen generates greedily
and a dense cache is teacher-forced on the same tokens. Recovery at a step: the share of the dense
model's attention for the new token that falls on what the head's compressed cache holds then.
The prompt row is profiling's number (the mean over all prompt query rows). Compressed heads:
{int(compressed.sum())} of {compressed.numel()} (prompts x layers x KV heads); Full heads recover 1.
Last columns: mean ± std per chosen policy (number of heads).

{decode_table}

## Which profiling predicts decoding

The same heads and runs; each head's policy is the paper's choice above, and only the estimate
of its recovery changes: over every prompt row or the last 32 (an observation window, as SnapKV
reads), with the first token's attention counted or left out of both the prompt-time and the
decode-time recovery. r: correlation across compressed heads between the prompt-time recovery and
the decode-time recovery (mean over the steps above); gap: prompt minus decode; last column: of
the heads whose prompt-time recovery reached T = {headline}, the share whose decode-time recovery
is below T.

{predict_table}
"""
    (out / "attention_study.md").write_text(report)
    (out / "attention_study.json").write_text(json.dumps(dict(
        command=command, machine=machine(), runtime_s=runtime, prompt_lens=lens, policies=names,
        sweep={str(t): {k: (v.tolist() if torch.is_tensor(v) else v) for k, v in s.items()}
               for t, s in summary.items()}, checks=checks, checks_ok=checks_ok,
        decode_steps=list(steps), decode_recovery=per_step.tolist(),
        decode_prompt_recovery=prompt_rec.tolist(), decode_choice=choice.tolist(),
        variants=list(VARIANTS), decode_variant_recovery=variants.tolist()), indent=1))
    print(report)
    return dict(summary=summary, checks=checks, checks_ok=checks_ok, per_step=per_step,
                prompt_rec=prompt_rec, choice=choice, runtime_s=runtime)


def parse_args(argv=None):
    import argparse
    p = argparse.ArgumentParser(
        prog="python -m studies.attention_study",
        description="Attention recovery vs KV compression per threshold, policy mix per layer, "
                    "and recovery while decoding.")
    p.add_argument("--quick", action="store_true", help="3 short prompts, T in {0.5, 0.9}, decode "
                   "steps 1 and 3: a smoke test for tiny checkpoints (seconds)")
    p.add_argument("--ckpt", help="HF-format checkpoint folder or Llama GGUF file "
                   "(default: SmolLM2-135M-Instruct)")
    p.add_argument("--out", default="results/attention_study",
                   help="output folder (default results/attention_study/)")
    p.add_argument("--n-prompts", type=int, default=30, help="prompts in the sweep (default 30)")
    p.add_argument("--min-tokens", type=int, default=512, help="shortest prompt (default 512)")
    p.add_argument("--max-tokens", type=int, default=2048, help="longest prompt (default 2048)")
    p.add_argument("--n-check", type=int, default=3, help="prompts on which the real cache runs at "
                   "every T to check the derived bytes (default 3)")
    p.add_argument("--n-decode", type=int, default=5, help="prompts for the decode check (default 5)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    return p.parse_args(argv)


if __name__ == "__main__":
    from generate import exit_on_user_error
    with exit_on_user_error():
        a = parse_args()
        if a.threads:
            torch.set_num_threads(a.threads)
        main(a.ckpt, a.out, a.quick, a.n_prompts, a.min_tokens, a.max_tokens,
             n_check=a.n_check, n_decode=a.n_decode,
             command=" ".join(["python -m studies.attention_study", *sys.argv[1:]]))
