"""The `localmoe` command line, run as a real subprocess."""

import json
import subprocess
import sys

import gguf
import numpy as np
import pytest


def localmoe(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "localmoe", *args], capture_output=True, text=True, input=stdin,
                          timeout=300, check=False)


def assert_clean_error(done, *fragments):
    """Exit 1, one `localmoe: error:` line naming the problem, and no traceback."""
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("localmoe: error:")]
    assert len(lines) == 1, done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_missing_model_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    assert_clean_error(localmoe("run", "hi", "--model", str(missing)), str(missing), "no such file")


def test_truncated_gguf(tmp_path, smollm2_gguf):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm2_gguf.read_bytes()[: 40 << 20])
    assert_clean_error(localmoe("run", "hi", "--model", str(cut)), "cut.gguf", "truncated")


def test_file_that_is_not_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(0).bytes(4096))
    assert_clean_error(localmoe("inspect", str(junk)), "junk.gguf", "GGUF")


def test_corrupt_safetensors_directory(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 8, "hidden_size": 4,
                                                      "num_hidden_layers": 1, "num_attention_heads": 1,
                                                      "intermediate_size": 8}))
    (tmp_path / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{not json")
    assert_clean_error(localmoe("run", "hi", "--model", str(tmp_path)), "model.safetensors")


def test_unknown_hf_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "perceiver9"}))
    assert_clean_error(localmoe("inspect", str(tmp_path)), "perceiver9", "llama", "qwen3")


def test_unknown_gguf_architecture_lists_supported(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba9")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_clean_error(localmoe("run", "hi", "--model", str(path)), "mamba9", "llama")


def test_bad_option_value():
    done = localmoe("run", "hi", "--temperature", "-1")
    assert_clean_error(done, "temperature")


@pytest.mark.slow
def test_run_json_answers(smollm2_gguf):
    done = localmoe("run", "What is the capital of France?", "--temperature", "0", "--max-tokens", "32", "--json",
                    "--model", str(smollm2_gguf))
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert "Paris" in answer["text"] and answer["finish_reason"] == "stop"
    assert answer["stats"]["generated_tokens"] >= 1 and "tokens/s" in done.stderr


def test_run_reads_prompt_from_stdin(smollm2_gguf):
    done = localmoe("run", "-", "--temperature", "0", "--max-tokens", "4", "--model", str(smollm2_gguf),
                    stdin="Say hello.")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


def test_inspect_default_model(smollm2_gguf):
    done = localmoe("inspect", str(smollm2_gguf), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert (info["model_type"], info["layers"], info["hidden_size"], info["heads"], info["kv_heads"]) == \
        ("llama", 30, 576, 9, 3)
    assert 134e6 < info["parameters_total"] < 136e6  # SmolLM2-135M with tied embeddings
    assert info["tensor_dtypes"]["Q4_1"]["tensors"] == 210
    text = localmoe("inspect", str(smollm2_gguf)).stdout
    assert "parameters" in text and "kv cache" in text and "with --dtype auto (blocks kept)" in text
    from localmoe.kernels import ggml_gemv

    from localmoe.load import load_model

    if ggml_gemv.kernel_available():  # the estimate is what loading really holds, blocks and all
        held = load_model(smollm2_gguf, progress=False).model.weight_bytes()
        assert abs(info["memory"]["weights_loaded_bytes"] - held) < 0.02 * held


MILLION = 1 << 20


def _k3_real_path():
    from pathlib import Path

    import localmoe.testing

    return Path(localmoe.testing.__file__).parent / "configs" / "kimi_k3_real.json"


def test_inspect_config_only_directory(tmp_path):
    (tmp_path / "config.json").write_text(_k3_real_path().read_text())
    done = localmoe("inspect", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert (info["model_type"], info["layers"], info["hidden_size"], info["vocab_size"]) == ("kimi_k3", 93, 7168,
                                                                                               163840)
    # published: ~2.8T parameters in all, ~104B active per token (MODELS.md); counted from the expected shapes
    assert 2.7e12 < info["parameters_total"] < 2.9e12 and 100e9 < info["parameters_active"] < 110e9
    assert info["memory"]["file_bytes"] == 0 and info["tensor_dtypes"] == {}


def test_inspect_k3_real_config_sizes_the_million_token_fp8_cache():
    done = localmoe("inspect", str(_k3_real_path()), "--kv-cache-dtype", "fp8", "--json")
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)["memory"]
    state = 69 * 4 * (96 * 128 * 128 + 3 * 3 * 96 * 128)  # 69 KDA layers: fp32 state [96, 128, 128] + conv tails
    fp8 = 24 * (512 + 64 + 4)  # 24 MLA layers: 576 e4m3 values + one fp32 scale per token
    assert m["delta_state_bytes"] == state
    assert m["kv_cache"]["fp8"]["bytes_per_token"] == m["kv_cache_bytes_per_token"] == fp8
    assert m["kv_cache"]["float32"]["bytes_per_token"] == 24 * 576 * 4
    assert m["kv_cache"]["fp8"]["total_at_1m_tokens"] == fp8 * MILLION + state <= 32e9
    text = localmoe("inspect", str(_k3_real_path()), "--kv-cache-dtype", "fp8").stdout
    line = next(line for line in text.splitlines() if "fp8 (selected)" in line)
    assert "13.6 KiB per token" in line and "13.6 GiB at 1M tokens" in line  # 13920 B; 13920 * 2^20 B
    assert "14.0 GiB with the delta state" in line  # (13920 * 2^20 + 464633856) / 2^30 = 14.03
    assert "delta state    443.1 MiB per sequence" in text


def test_inspect_rejects_an_unknown_cache_dtype():
    done = localmoe("inspect", str(_k3_real_path()), "--kv-cache-dtype", "int2")
    assert done.returncode == 2 and "int2" in done.stderr


def test_engine_options_reach_the_engine_config():
    """model_options hands the command one EngineConfig value: engine flags and, nested, the paging flags."""
    import click
    from click.testing import CliRunner

    from localmoe.commands.options import model_options

    seen = []

    @click.command()
    @model_options
    def probe(model, engine):
        seen.append(engine)

    assert CliRunner().invoke(probe, []).exit_code == 0
    flags = ["--expert-precision", "exact", "--threads", "3", "--ram", "8M", "--policy", "lru", "--no-prefetch"]
    assert CliRunner().invoke(probe, flags).exit_code == 0
    assert (seen[0].expert_precision, seen[1].expert_precision, seen[1].threads) == ("q8", "exact", 3)
    assert (seen[0].paging.ram_budget, seen[0].paging.policy, seen[0].paging.prefetch) == (0, "lfru", True)
    assert (seen[1].paging.ram_budget, seen[1].paging.policy, seen[1].paging.prefetch) == (8 << 20, "lru", False)


def test_serve_refuses_a_documents_root_that_is_not_a_folder(tmp_path):
    done = localmoe("serve", "--documents-root", str(tmp_path / "nope"), "--port", "1")
    assert done.returncode == 1 and "--documents-root" in done.stderr and "not a folder" in done.stderr
    assert "Traceback" not in done.stderr
