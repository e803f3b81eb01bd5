"""The fastllm command keeps Python's bytecode under its cache directory when PYTHONDONTWRITEBYTECODE is set.

Each case runs in a fresh interpreter: keep_bytecode changes process-wide settings."""

import os
import subprocess
import sys

PROBE = """
import os, sys
from fastllm.compile_cache import keep_bytecode
prefix = keep_bytecode()
sys.path.insert(0, sys.argv[1])
import probe_mod
print(prefix, os.environ.get("PYTHONPYCACHEPREFIX"), os.environ.get("PYTHONDONTWRITEBYTECODE"))
"""


def run_probe(tmp_path, **env_extra):
    src = tmp_path / "src"
    src.mkdir()
    (src / "probe_mod.py").write_text("X = 1\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE",
                                                             "FASTLLM_BYTECODE_CACHE")}
    env.update(FASTLLM_CACHE_DIR=str(tmp_path / "cache"), **env_extra)
    out = subprocess.run([sys.executable, "-c", PROBE, str(src)], env=env, capture_output=True, text=True,
                         check=True)
    return out.stdout.split(), src


def pyc_files(root, stem):
    return sorted(p.name for p in root.rglob(f"{stem}*.pyc")) if root.exists() else []


def test_bytecode_goes_to_the_cache_dir_when_writing_is_off(tmp_path):
    (prefix, env_prefix, env_flag), src = run_probe(tmp_path, PYTHONDONTWRITEBYTECODE="1")
    assert prefix == env_prefix == str(tmp_path / "cache" / "pycache")
    assert env_flag == "None"  # child processes inherit the prefix, not the flag
    assert pyc_files(tmp_path / "cache" / "pycache", "probe_mod")
    assert not (src / "__pycache__").exists()  # the source tree is untouched


def test_opt_out_leaves_python_alone(tmp_path):
    (prefix, env_prefix, env_flag), src = run_probe(tmp_path, PYTHONDONTWRITEBYTECODE="1",
                                                    FASTLLM_BYTECODE_CACHE="0")
    assert (prefix, env_prefix, env_flag) == ("None", "None", "1")
    assert not pyc_files(tmp_path, "probe_mod")


def test_nothing_changes_when_bytecode_writing_is_on(tmp_path):
    (prefix, env_prefix, _), src = run_probe(tmp_path)
    assert (prefix, env_prefix) == ("None", "None")
    assert pyc_files(src / "__pycache__", "probe_mod")  # Python's own place
    assert not (tmp_path / "cache").exists()


def test_the_command_sets_it_before_its_imports(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}
    env.update(FASTLLM_CACHE_DIR=str(tmp_path), PYTHONDONTWRITEBYTECODE="1")
    subprocess.run([sys.executable, "-m", "fastllm.entrypoints.cli", "--help"], env=env, check=True,
                   capture_output=True)
    # the bench subcommand's module is imported inside main(), after keep_bytecode
    assert pyc_files(tmp_path / "pycache", "bench")
