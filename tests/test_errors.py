"""Bad input fails with one clear line and the right exit status; Ctrl-C keeps what was made."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import generate
import generation
from generate import cli, main
from generation import CacheOptions
from model import CheckpointError, load_model


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path):
    """A private copy of the tiny checkpoint that a test may damage."""
    return shutil.copytree(tiny_ckpt, tmp_path / "copy")


def run(capsys, *args):
    status = cli(list(args))
    out = capsys.readouterr()
    return status, out.out, out.err


def edit_config(ckpt, **changes):
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(config | changes))


def edit_weights(ckpt, fn):
    sd = load_file(ckpt / "model.safetensors")
    fn(sd)
    save_file(sd, ckpt / "model.safetensors")


@pytest.mark.parametrize("damage, words", [
    (lambda c: (c / "config.json").unlink(), "config.json is missing"),
    (lambda c: (c / "config.json").write_text("{not json"), "cannot be read as JSON"),
    (lambda c: (c / "tokenizer.json").unlink(), "no tokenizer.json or tokenizer.model"),
    (lambda c: (c / "model.safetensors").unlink(), "no model.safetensors"),
    (lambda c: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:5000]), "damaged or truncated"),
    (lambda c: edit_config(c, model_type="gpt2"), "only Llama-family"),
    (lambda c: edit_config(c, hidden_size=32), "has shape"),
    (lambda c: edit_weights(c, lambda sd: sd.pop("model.norm.weight")), "missing tensors"),
    (lambda c: edit_weights(c, lambda sd: sd.update(extra=torch.ones(1))), "unexpected tensors"),
])
def test_damaged_checkpoint_is_one_line_and_status_1(ckpt, capsys, damage, words):
    damage(ckpt)
    status, _, err = run(capsys, "--ckpt", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2")
    assert status == 1
    assert words in err and err.count("\n") == 1


def test_pickle_is_refused_unless_opted_in(ckpt, capsys):
    sd = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(sd, ckpt / "pytorch_model.bin")
    status, _, err = run(capsys, "--ckpt", str(ckpt), "--prompt", "hi", "--max-new-tokens", "2")
    assert status == 1 and "--allow-pickle" in err
    model = load_model(ckpt, allow_pickle=True)
    assert torch.equal(model.norm.weight, sd["model.norm.weight"])


def test_pickle_with_code_is_refused_even_when_opted_in(ckpt):
    (ckpt / "model.safetensors").unlink()
    torch.save({"model.norm.weight": torch.ones(2), "evil": print}, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused even with --allow-pickle"):
        load_model(ckpt, allow_pickle=True)


def test_ctrl_c_keeps_the_text_so_far(tiny_ckpt, capsys, monkeypatch):
    calls = []

    def interrupted_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_step(*args, **kwargs)

    real_step = generation.decode_one_token
    monkeypatch.setattr(generation, "decode_one_token", interrupted_step)
    status, out, err = run(capsys, "--ckpt", str(tiny_ckpt), "--prompt", "Hello, world",
                           "--max-new-tokens", "12")
    assert status == 130 and "interrupted" in err
    calls.clear()
    gen = main("Hello, world", ckpt=str(tiny_ckpt), max_new_tokens=12)
    assert gen.interrupted and len(gen.tokens[0]) == 4  # prefill's token + 3 decode steps


def test_out_of_memory_says_how_big_and_what_to_lower(tiny_ckpt, capsys, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(generate, "generate", no_memory)
    status, _, err = run(capsys, "--ckpt", str(tiny_ckpt), "--prompt", "hi")
    assert status == 1 and "GiB" in err and "--max-new-tokens" in err


def test_full_and_fastgen_at_recovery_1_give_the_same_tokens(tiny_ckpt):
    prompts = ["Hello, world! How are you?", "The quick brown fox jumps over the lazy dog."]
    full = main(prompts, ckpt=str(tiny_ckpt), max_new_tokens=10, cache=CacheOptions("full"))
    fast = main(prompts, ckpt=str(tiny_ckpt), max_new_tokens=10,
                cache=CacheOptions("fastgen", paper=True, recovery=1.0))
    assert full.tokens == fast.tokens


@pytest.mark.parametrize("script", ["bench", "scaling", "evaluate", "attention_study"])
def test_study_scripts_name_a_missing_checkpoint_in_one_line(script, tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-m", f"studies.{script}", "--quick",
                        "--ckpt", str(tmp_path / "missing")], capture_output=True, text=True,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [f"error: checkpoint folder {tmp_path / 'missing'} "
                                             "does not exist"]


@pytest.mark.parametrize("make, args, status, words", [
    (lambda d: (d / "p.txt").write_bytes(b"\xff\xfe not utf-8"), ["--prompt-file", "{d}/p.txt"], 2,
     "is not UTF-8 text"),
    (lambda d: (d / "folder").mkdir(), ["--prompt-file", "{d}/folder"], 2, "Is a directory"),
    (lambda d: None, ["--prompt-file", "{d}/missing.txt"], 2, "No such file"),
    (lambda d: None, ["--prompt", "hi", "--save-plan", "{d}/no/such/plan.json"], 2,
     "its folder does not exist"),
    (lambda d: None, ["--prompt", "hi", "--save-plan", "{d}"], 2, "is a folder"),
    (lambda d: None, ["--prompt", "hi", "--seed", "-1"], 2, "--seed"),
    (lambda d: (d / "m.gguf").write_text("hello"), ["--prompt", "hi", "--ckpt", "{d}/m.gguf"], 1,
     "not a GGUF file"),
    (lambda d: (d / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x05"), ["--prompt", "hi", "--ckpt",
     "{d}/cut.gguf"], 1, "not a readable GGUF file"),
    (lambda d: None, ["--interactive", "--prompt", "hi"], 2, "drop --prompt"),
])
def test_user_paths_and_sizes_are_one_line(tiny_ckpt, tmp_path, capsys, monkeypatch, make, args, status, words):
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    make(tmp_path)
    args = [a.replace("{d}", str(tmp_path)) for a in args]
    ckpt = [] if "--ckpt" in args else ["--ckpt", str(tiny_ckpt)]
    assert cli(ckpt + args + ["--max-new-tokens", "2"]) == status
    err = capsys.readouterr().err
    # (a GGUF file is announced on a line of its own before it is converted)
    assert words in err.splitlines()[-1] and err.count("\n") <= 2 and "Traceback" not in err


@pytest.mark.parametrize("args, what", [(["--prompt", "caf\udce9"], "--prompt"),
                                        (["--prompt-file", "-"], "--prompt-file standard input")])
def test_prompts_that_are_not_utf8_are_one_line(tiny_ckpt, capsys, monkeypatch, args, what):
    """The command line, and a standard input decoded leniently, hand over bytes that are not
    UTF-8 as surrogate escapes: refused in one line, as a file that is not UTF-8 is."""
    import io
    import sys
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"caf\xe9"),
                                                       errors="surrogateescape"))
    assert cli(["--ckpt", str(tiny_ckpt), *args]) == 2
    assert capsys.readouterr().err == (f"error: {what} is not UTF-8 text (byte 3); convert it, "
                                       "e.g. with iconv\n")


def test_read_only_cache_folder_is_one_line(tmp_path, capsys, monkeypatch):
    from test_convert_gguf import write_tiny_gguf
    write_tiny_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "cache").write_text("a file where the cache folder should be")
    monkeypatch.setenv("FASTGEN_CACHE", str(tmp_path / "cache"))
    assert cli(["--ckpt", str(tmp_path / "tiny.gguf"), "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert "set FASTGEN_CACHE to a writable folder" in err and err.count("\n") == 2  # + "converting"


@pytest.mark.parametrize("argv, words", [
    (["bench", "--quick", "--out", "{d}/no/such/report.md"], "give a file in an existing folder"),
    (["bench", "--quick", "--prompt-file", "{d}/bad.txt"], "is not UTF-8 text"),
    (["scaling", "--quick", "--out", "{d}/file.txt/scaling"], "file.txt"),
    (["attention_study", "--quick", "--out", "{d}/file.txt/study"], "file.txt"),
    (["reproduce", "--quick", "--out", "{d}/file.txt/all"], "Not a directory"),
])
def test_scripts_answer_bad_paths_in_one_line(tiny_ckpt, tmp_path, argv, words):
    import subprocess
    import sys
    from pathlib import Path
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe")
    (tmp_path / "file.txt").write_text("x")
    argv = [a.replace("{d}", str(tmp_path)) for a in argv]
    r = subprocess.run([sys.executable, "-m", f"studies.{argv[0]}", *argv[1:],
                        "--ckpt", str(tiny_ckpt)], capture_output=True, text=True, timeout=300,
                       cwd=Path(__file__).parents[1])
    # One line of error, after argparse's usage lines where argparse reports it.
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert words in r.stderr.strip().splitlines()[-1], r.stderr
