"""llama.cpp's C++ tools as `tandem bench decode --peers llama` runners: the commands built, their real output parsed
(tests/bench/fake_llama_tools holds outputs captured from a build of llama-cpp-python 0.3.36's llama.cpp, replayed by
a fake tool), the ids recovered from their text, the set-up checks, and bits per weight of a GGUF."""
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from tandem.bench.speculation.decode import DecodeBenchConfig
from tandem.bench.peers.llama_tools import ToolMode, ToolRunner, command, generated_text, parse_timings, tool_modes, tool_runners
from tandem.errors import InvalidParameterError

FAKE = Path(__file__).with_name("fake_llama_tools")
TOOLS = ("llama-completion", "llama-speculative-simple", "llama-lookup", "llama-tokenize")


class ByteTokenizer:
    """ids = UTF-8 bytes; 300 = <|im_end|> (EOS, kept in text as the marker), as tandem's tokenizers keep specials."""

    eos_token_id = 300

    def encode(self, text, add_special_tokens=True):
        out = []
        for i, part in enumerate(text.split("<|im_end|>")):
            out += ([300] if i else []) + list(part.encode())
        return out

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<|im_end|>" if i == 300 else bytes([i]).decode("latin-1") for i in ids)


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """$TANDEM_HOME with a "build" whose tools are the fake, logging their argv to argv.jsonl."""
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("FAKE_LLAMA_ARGV", str(tmp_path / "argv.jsonl"))
    from tandem.bench.peers import llama_build

    bins = llama_build.bin_dir()
    bins.mkdir(parents=True)
    for tool in TOOLS:
        (bins / tool).write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE / 'fake_tool.py'} {tool} \"$@\"\n")
        (bins / tool).chmod(0o755)
    return bins


# What the fixtures' logs report (tests/bench/fake_llama_tools/TOOL.stderr): prompt and decode seconds, decode tokens,
# tokens generated, drafted / accepted
REAL = {
    "cli": {"prompt_s": 4.72738, "decode_s": 43.01105, "decode_tokens": 23, "tokens": 24},
    "spec": {"prompt_s": 15.931, "decode_s": 31.145, "decode_tokens": 27, "tokens": 27, "drafted": 21, "accepted": 21},
    "lookup": {"prompt_s": 4.355, "decode_s": 24.004, "decode_tokens": 25, "tokens": 25, "drafted": 24, "accepted": 1},
}
TEXT = {
    "cli": ("Here's a Python function to check if a number is prime:\n\n```python\ndef is_prime(number):\n    \"\"\"\n   ", False),
    "spec": ("Here's a Python function to check if a number is prime:\n\n```python\ndef is_prime(number):\n    \"\"\"\n    Check if a", False),
    "lookup": ("Here's a Python function to check if a number is prime:\n\n```python\ndef is_prime(number):\n    \"\"\"\n    Check", False),
}
TOOL_OF = {"cli": "llama-completion", "spec": "llama-speculative-simple", "lookup": "llama-lookup"}


@pytest.mark.parametrize("mode", ["cli", "spec", "lookup"])
def test_each_tools_output_is_parsed(mode):
    stderr = (FAKE / f"{TOOL_OF[mode]}.stderr").read_text()
    stdout = (FAKE / f"{TOOL_OF[mode]}.stdout").read_text()
    assert parse_timings(mode, stderr) == pytest.approx(REAL[mode])
    assert generated_text(mode, stdout, (FAKE / f"{TOOL_OF[mode]}.prompt").read_text()) == TEXT[mode]


def test_end_of_text_and_a_foreign_prompt_are_recognised():
    assert generated_text("cli", "def f(): pass [end of text]\n\n\n", "P") == ("def f(): pass", True)
    with pytest.raises(RuntimeError, match="does not start with the prompt"):
        generated_text("lookup", "\n\nOTHER PROMPT abc\n\n\n\n", "P")
    with pytest.raises(RuntimeError, match="no 'decoded' line"):
        parse_timings("spec", "encoded   35 tokens in    0.401 seconds, speed:   87.282 t/s\n")


def test_runners_run_the_tools_on_tandems_prompt_ids(fake_tools, tmp_path):
    config = DecodeBenchConfig(max_tokens=24, llama_spec=((8, 0, 0.75),), llama_lookup=(8,))
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("Say hi.")
    info = {}
    runners = tool_runners(config, tmp_path / "t.gguf", tmp_path / "d.gguf", [300, 301], 512, 2, ["cli", "spec", "lookup"],
                           tokenizer, [ids], info)
    assert list(runners) == ["llama_cli", "llama_spec_d8_m0_p0.75", "llama_lookup_d8"]
    assert info["system_info"].startswith("n_threads = 2 (n_threads_batch = 2) / 2 | CPU : SSE3 = 1")
    assert info["tools"]["llama_spec_d8_m0_p0.75"] == {"tool": "llama-speculative-simple", "draft_max": 8, "draft_min": 0, "p_min": 0.75}
    spec = runners["llama_spec_d8_m0_p0.75"]([ids])[0]
    assert (spec.count, spec.seconds) == (27, pytest.approx(15.931 + 31.145))  # the tool's own count and time
    assert spec.token_ids == tokenizer.encode(TEXT["spec"][0])[:24]  # a round past max tokens: cut
    assert spec.metrics == {"steps": 5, "drafted_tokens": 21, "accepted_tokens": 21, "draft_time_s": 0.0, "mean_draft_length": 4.2,
                            "decode_tokens": 27, "decode_s": 31.145}
    lookup = runners["llama_lookup_d8"]([ids])[0]
    assert lookup.token_ids == tokenizer.encode(TEXT["lookup"][0])[:24]  # bytes here, more of them than the tool's tokens
    assert (lookup.count, lookup.metrics["steps"], lookup.metrics["accepted_tokens"]) == (25, 23, 1)
    cli = runners["llama_cli"]([ids])[0]
    assert (cli.count, cli.metrics) == (24, {"decode_tokens": 23, "decode_s": pytest.approx(43.01105)})
    argv = [json.loads(line) for line in (tmp_path / "argv.jsonl").read_text().splitlines()]
    tools = [a[0] for a in argv]
    assert tools == ["llama-tokenize", "llama-completion", "llama-completion", "llama-speculative-simple", "llama-lookup", "llama-completion"]
    assert argv[2] == ["llama-completion", "--version"] and info["version"] == "version: 1 (0c1e570) | built with GNU 12.2.0 for Linux x86_64"
    assert argv[3][argv[3].index("-p") + 1] == "Say hi." and argv[3][argv[3].index("-md") + 1] == str(tmp_path / "d.gguf")


def test_a_gguf_of_another_vocabulary_or_a_failing_tool_is_refused(fake_tools, tmp_path):
    config = DecodeBenchConfig(max_tokens=8)
    tokenizer = ByteTokenizer()
    with pytest.raises(InvalidParameterError, match="not the same vocabulary"):
        tool_runners(config, tmp_path / "other.gguf", None, [300], 64, 2, ["cli"], tokenizer, [tokenizer.encode("hi")], {})
    runner = ToolRunner(fake_tools / "llama-lookup", ToolMode("lookup", 8), tmp_path / "broken.gguf", None, tokenizer, [300], 2, 64)
    with pytest.raises(RuntimeError, match="llama-lookup exited 1: llama_model_load: error loading model"):
        runner([tokenizer.encode("hi")], 8)


def test_commands_are_what_a_user_types():
    spec = ToolMode("spec", draft_max=8, draft_min=2, p_min=0.75)
    args = dict(gguf=Path("t.gguf"), draft=Path("d.gguf"), prompt="P\n", max_tokens=128, threads=2, n_ctx=512)
    common = ["-m", "t.gguf", "-p", "P\n", "--no-escape", "-n", "128", "-c", "512", "-t", "2", "-tb", "2", "--temp", "0", "--seed", "0"]
    assert command(Path("/b/llama-completion"), ToolMode("cli"), **args) == ["/b/llama-completion", *common, "-no-cnv", "--no-display-prompt"]
    assert command(Path("/b/llama-speculative-simple"), spec, **args) == [
        "/b/llama-speculative-simple", *common, "--spec-draft-n-max", "8", "--spec-type", "draft-simple", "-md", "d.gguf", "--spec-draft-n-min", "2",
        "--spec-draft-p-min", "0.75", "-td", "2", "-tbd", "2"]
    assert command(Path("/b/llama-lookup"), ToolMode("lookup", draft_max=6), **args) == ["/b/llama-lookup", *common, "--spec-draft-n-max", "6"]
    assert (spec.name, ToolMode("lookup", 6).name, ToolMode("cli").name) == ("llama_spec_d8_m2_p0.75", "llama_lookup_d6", "llama_cli")


def test_modes_and_settings_are_checked_before_any_model_loads(tmp_path):
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    config = DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_spec=((8, 0, 0.75), (4, 1, 0.0)), llama_lookup=(8, 4))
    assert [m.name for m in tool_modes(config, ["cli", "spec", "lookup"])] == [
        "llama_cli", "llama_spec_d8_m0_p0.75", "llama_spec_d4_m1_p0", "llama_lookup_d8", "llama_lookup_d4"]
    with pytest.raises(InvalidParameterError, match="spec / draft need a draft model"):
        DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_modes=("cli", "spec"))
    with pytest.raises(InvalidParameterError, match="unknown \\['beam'\\]"):
        DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_modes=("beam",))
    with pytest.raises(InvalidParameterError, match="--llama-spec 4:5:0.5: needs"):
        DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_draft_gguf=str(gguf), llama_spec=((4, 5, 0.5),))
    with pytest.raises(InvalidParameterError, match="lookup lengths >= 1"):
        DecodeBenchConfig(peers=("llama",), llama_gguf=str(gguf), llama_lookup=(0,))


def test_cli_names_the_tools_set_up_and_checks_the_settings(tmp_path, monkeypatch, capsys):
    from tandem.cli import main

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"GGUF")
    assert main(["bench", "decode", "--model", str(tmp_path / "no-model"), "--peers", "llama", "--llama-gguf", str(gguf)]) == 1
    err = capsys.readouterr().err
    assert "no llama-completion at" in err and "tandem peers setup llama-cpp" in err
    assert main(["bench", "decode", "--peers", "llama", "--llama-gguf", str(gguf), "--llama-spec", "8:0"]) == 1
    assert "DRAFT_MAX:DRAFT_MIN:P_MIN" in capsys.readouterr().err


def test_ids_come_back_from_the_text_with_the_eos_the_tool_did_not_print():
    runner = ToolRunner(Path("x"), ToolMode("spec", 4), Path("t"), Path("d"), ByteTokenizer(), [300, 301], threads=2, n_ctx=64)
    assert runner.ids_of("ab", stopped=True, max_tokens=8) == [97, 98, 300]  # stopped early: its EOS back
    assert runner.ids_of("abcdefghij", stopped=False, max_tokens=8) == list(b"abcdefgh")  # a round past max tokens: cut
    assert runner.ids_of("ab<|im_end|>", stopped=True, max_tokens=8) == [97, 98, 300]  # lookup prints its EOS
    assert runner.ids_of("abcdefgh", stopped=True, max_tokens=8) == list(b"abcdefgh")  # max tokens reached first


def _gguf(path: Path, head: bool) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_file_type(7)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", np.ones(32, dtype=np.float32))  # a norm vector: not counted
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((8, 32), dtype=np.float16))
    q8 = np.zeros((8, 34), dtype=np.uint8)  # Q8_0: a block of 32 weights = an fp16 scale + 32 int8 = 34 bytes
    writer.add_tensor("blk.0.ffn_up.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    if head:
        writer.add_tensor("output.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_bits_per_weight_of_a_gguf_split_by_blocks_head_and_embeddings(tmp_path):
    from tandem.bench.peers.bits import gguf_bits

    bits = gguf_bits(_gguf(tmp_path / "h.gguf", head=True))
    assert bits == {"blocks": 12.25, "lm_head": 8.5, "embeddings": 32.0, "file_type": "Q8_0",  # (16 + 8.5) / 2 in the blocks
                    "types": {"blocks": ["F16", "Q8_0"], "lm_head": ["Q8_0"], "embeddings": ["F32"]}}
    tied = gguf_bits(_gguf(tmp_path / "t.gguf", head=False))
    assert tied["lm_head"] == 32.0 and tied["types"]["lm_head"] == ["F32"]  # no output.weight: the embeddings are the head


def test_bits_per_weight_of_a_tandem_model_as_served(tiny_llama):
    from tandem.bench.peers.bits import model_bits
    from tandem.llm import LLM

    fp32 = model_bits(LLM(model=tiny_llama, max_batch_size=1).target)
    assert fp32 == {"blocks": 32.0, "lm_head": 32.0, "embeddings": 32}


def test_setup_builds_the_tools_natively_once_and_records_the_build(tmp_path, monkeypatch):
    """`tandem peers setup llama-cpp` with a local sdist and a fake cmake (no network, no compiler run)."""
    import tarfile

    from tandem.bench.peers import llama_build

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    vendor = tmp_path / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    vendor.mkdir(parents=True)
    (vendor / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (llama_build.root() / "dl").mkdir(parents=True)
    with tarfile.open(llama_build.root() / "dl" / "llama_cpp_python-0.3.36.tar.gz", "w:gz") as archive:
        archive.add(tmp_path / "sdist" / "llama_cpp_python-0.3.36", "llama_cpp_python-0.3.36")
    fake_bin = tmp_path / "fakebin"
    fake_bin.mkdir()
    (fake_bin / "cmake").write_text(f"""#!{sys.executable}
import json, sys
from pathlib import Path
args = sys.argv[1:]
open({str(tmp_path / 'cmake.jsonl')!r}, "a").write(json.dumps(args) + "\\n")
if args[0] == "--build":
    for name in args[args.index("--target") + 1:]:
        tool = Path(args[1]) / "bin" / name
        tool.parent.mkdir(parents=True, exist_ok=True)
        tool.write_text("#!/bin/sh\\necho 'version: 1 (0c1e570)' >&2\\necho 'built with GNU 12.2.0 for Linux x86_64' >&2\\n")
        tool.chmod(0o755)
else:
    Path(args[args.index("-B") + 1]).mkdir(parents=True, exist_ok=True)
    (Path(args[args.index("-B") + 1]) / "CMakeCache.txt").write_text("")
""")
    (fake_bin / "cmake").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}:{Path(sys.executable).parent}:/usr/bin:/bin")
    info = llama_build.setup(jobs=3)
    build = str(llama_build.root() / "build")
    source = str(llama_build.root() / "src" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp")
    calls = [json.loads(line) for line in (tmp_path / "cmake.jsonl").read_text().splitlines()]
    assert calls == [["-S", source, "-B", build, "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF",
                      "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DBUILD_SHARED_LIBS=OFF"],
                     ["--build", build, "-j", "3", "--target", *llama_build.NEEDED]]
    assert info["version"] == "version: 1 (0c1e570) | built with GNU 12.2.0 for Linux x86_64"
    assert info["targets"] == sorted(llama_build.NEEDED) and llama_build.built_info() == info
    assert llama_build.setup() == info and len((tmp_path / "cmake.jsonl").read_text().splitlines()) == 2  # built: nothing runs
    more = llama_build.setup(targets=llama_build.NEEDED + ("llama-server",))  # one more target: built, not configured again
    calls = [json.loads(line) for line in (tmp_path / "cmake.jsonl").read_text().splitlines()]
    assert calls[2] == ["--build", build, "-j", "2", "--target", *llama_build.NEEDED, "llama-server"] and len(calls) == 3
    assert more["targets"] == sorted(llama_build.NEEDED + ("llama-server",))
    assert llama_build.tool("llama-server") == llama_build.bin_dir() / "llama-server"


def test_llama_runners_record_versions_bits_and_settings(fake_tools, tmp_path):
    from types import SimpleNamespace

    from tandem.bench.speculation.decode import _bits_per_runner
    from tandem.bench.peers.llama_peer import llama_runners

    target, draft = _gguf(tmp_path / "t.gguf", head=True), _gguf(tmp_path / "d.gguf", head=False)
    config = DecodeBenchConfig(peers=("llama",), llama_gguf=str(target), llama_draft_gguf=str(draft), max_tokens=24)
    tokenizer = ByteTokenizer()
    base = SimpleNamespace(tokenizer=tokenizer, target=SimpleNamespace(cfg=SimpleNamespace(eos_token_ids={300})))
    runners, info = llama_runners(base, config, [tokenizer.encode("Say hi.")])
    assert list(runners) == ["llama_cli", "llama_spec_d8_m0_p0.75", "llama_lookup_d8"]  # default modes, with a draft GGUF
    assert (info["file_type"], info["weights"], info["modes"], info["n_ctx"]) == ("Q8_0", "int8", ["cli", "spec", "lookup"], 64)
    info["runners"] = list(runners)
    bits = _bits_per_runner({}, [], info)
    assert bits["llama_cli"] == {"target": info["bits_per_weight"]} and info["bits_per_weight"]["lm_head"] == 8.5
    assert bits["llama_spec_d8_m0_p0.75"]["draft"]["lm_head"] == 32.0  # the draft GGUF ties its head to the F32 embeddings
