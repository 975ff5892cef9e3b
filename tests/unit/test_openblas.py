"""The OpenBLAS re-exec: decision logic with a faked host, and one real re-exec."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import engine
from engine.platform import openblas
from engine.platform.openblas import (
    PRELOADED_ENV,
    REEXEC_ENV,
    Backend,
    blas_report,
    detect_backend,
    find_openblas,
    maybe_reexec_with_openblas,
    reexec_argv,
    reexec_environ,
    reexec_notice,
    should_reexec,
)

pytestmark = pytest.mark.unit

OUR_ENV = (
    "LD_PRELOAD",
    REEXEC_ENV,
    PRELOADED_ENV,
    openblas.PATH_ENV,
    openblas.BACKEND_ENV,
)


@pytest.fixture
def fake_linux_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An x86_64 Linux CPU host whose system OpenBLAS lives under ``tmp_path``."""
    for name in OUR_ENV:
        monkeypatch.delenv(name, raising=False)
    library = tmp_path / "x86_64-linux-gnu" / "openblas-pthread" / "libblas.so.3"
    library.parent.mkdir(parents=True)
    library.write_bytes(b"")
    monkeypatch.setattr(openblas, "SYSTEM_LIB_DIR", tmp_path)
    monkeypatch.setattr(openblas.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(openblas, "CUDA_DISTRIBUTIONS", ("no-such-mlx-cuda-wheel",))
    return library


# -- finding the library -----------------------------------------------------------------


def test_finds_the_system_library_for_the_machine(fake_linux_cpu: Path) -> None:
    assert find_openblas() == fake_linux_cpu


def test_uses_the_aarch64_multiarch_directory(
    fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openblas.platform, "machine", lambda: "aarch64")
    assert find_openblas() is None
    arm = openblas.SYSTEM_LIB_DIR / "aarch64-linux-gnu" / "openblas-pthread" / "libblas.so.3"
    arm.parent.mkdir(parents=True)
    arm.write_bytes(b"")
    assert find_openblas() == arm


def test_explicit_path_wins_and_is_not_second_guessed(
    fake_linux_cpu: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    custom = tmp_path / "custom" / "libopenblas.so.0"
    custom.parent.mkdir()
    custom.write_bytes(b"")
    monkeypatch.setenv(openblas.PATH_ENV, str(custom))
    assert find_openblas() == custom
    monkeypatch.setenv(openblas.PATH_ENV, str(tmp_path / "missing.so"))
    assert find_openblas() is None
    assert "missing.so is not a file" in openblas.reexec_decision(True).reason


# -- the decision -------------------------------------------------------------------------


def test_reexecs_on_linux_cpu_with_the_library(fake_linux_cpu: Path) -> None:
    assert should_reexec(enabled=True)


def test_disabled_by_setting(fake_linux_cpu: Path) -> None:
    assert not should_reexec(enabled=False)


def test_never_loops_once_reexecuted(fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REEXEC_ENV, "1")
    assert not should_reexec(enabled=True)


def test_off_when_already_preloaded(fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", f"/opt/other.so {fake_linux_cpu}")
    assert openblas.openblas_preloaded()
    assert not should_reexec(enabled=True)


def test_off_on_macos(fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "platform", "darwin")
    assert detect_backend() is Backend.METAL
    assert not should_reexec(enabled=True)


def test_off_when_the_cuda_wheel_is_installed(
    fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # mlx-lm is certainly installed: let it stand in for the CUDA wheel.
    monkeypatch.setattr(openblas, "CUDA_DISTRIBUTIONS", ("mlx-cuda-13", "mlx-lm"))
    assert detect_backend() is Backend.CUDA
    assert not should_reexec(enabled=True)


def test_backend_env_overrides_detection(
    fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(openblas.BACKEND_ENV, "cuda")
    assert not should_reexec(enabled=True)
    monkeypatch.setattr(openblas, "CUDA_DISTRIBUTIONS", ("mlx-lm",))
    monkeypatch.setenv(openblas.BACKEND_ENV, "CPU")
    assert should_reexec(enabled=True)
    monkeypatch.setenv(openblas.BACKEND_ENV, "rocm")
    with pytest.raises(ValueError, match="SEMANTIC_BACKEND must be one of cpu, cuda, metal"):
        detect_backend()


def test_missing_library_is_logged_not_fatal(
    fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_linux_cpu.unlink()
    lines: list[str] = []
    maybe_reexec_with_openblas(["semantic"], enabled=True, log=lines.append)
    assert len(lines) == 1
    assert "OpenBLAS not found" in lines[0] and "libopenblas0-pthread" in lines[0]


# -- the exec itself (os.execve faked) ------------------------------------------------------


def test_environment_prepends_and_keeps_existing_preload(fake_linux_cpu: Path) -> None:
    env = reexec_environ(fake_linux_cpu, {"LD_PRELOAD": "/opt/a.so", "HOME": "/h"})
    assert env["LD_PRELOAD"] == f"{fake_linux_cpu}:/opt/a.so"
    assert env[REEXEC_ENV] == "1"
    assert env[PRELOADED_ENV] == str(fake_linux_cpu)
    assert env["HOME"] == "/h"
    assert reexec_environ(fake_linux_cpu, {})["LD_PRELOAD"] == str(fake_linux_cpu)


def test_execs_the_same_program_with_the_same_arguments(
    fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(openblas.os, "execve", lambda *args: calls.append(args))
    monkeypatch.setenv("LD_PRELOAD", "/opt/a.so")
    monkeypatch.setattr(sys, "argv", ["/venv/bin/semantic", "--serve"])
    launched = ["python3", "-X", "utf8", "/venv/bin/semantic", "--serve"]
    monkeypatch.setattr(sys, "orig_argv", launched)
    maybe_reexec_with_openblas(sys.argv, enabled=True, log=pytest.fail)
    [(executable, argv, env)] = calls
    assert executable == sys.executable
    assert argv == [sys.executable, "-X", "utf8", "/venv/bin/semantic", "--serve"]
    assert env["LD_PRELOAD"] == f"{fake_linux_cpu}:/opt/a.so"


def test_argv_of_a_python_dash_m_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Under -m, sys.argv[0] is the module's file: re-running that file as a
    # script would lose the package, so the -m form must be kept.
    monkeypatch.setattr(sys, "argv", ["/src/semantic_cli/__main__.py", "--tui", "x y"])
    monkeypatch.setattr(sys, "orig_argv", ["py", "-m", "semantic_cli", "--tui", "x y"])
    assert reexec_argv(sys.argv) == [sys.executable, "-m", "semantic_cli", "--tui", "x y"]


def test_notice_only_in_the_reexecuted_process(
    fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert reexec_notice() is None
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)  # `make test` sets it for its parallel parts
    monkeypatch.setenv(REEXEC_ENV, "1")
    monkeypatch.setenv(PRELOADED_ENV, str(fake_linux_cpu))
    monkeypatch.setattr(openblas, "active_openblas", lambda: fake_linux_cpu)
    assert reexec_notice() == f"OpenBLAS preloaded from {fake_linux_cpu} (re-exec)"
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert reexec_notice() == f"OpenBLAS preloaded from {fake_linux_cpu} (re-exec, 3 BLAS threads)"
    monkeypatch.setattr(openblas, "active_openblas", lambda: None)
    assert "did not load" in (reexec_notice() or "")


def test_blas_report_without_preload(fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # numpy's own OpenBLAS is mapped in every process that imports numpy; MLX's matmul does not use it.
    numpy_blas = "/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so"
    monkeypatch.setattr(openblas, "_mapped_files", lambda: ["/usr/lib/libc.so.6", numpy_blas])
    assert blas_report() == {
        "backend": "cpu",
        "blas": "bundled reference BLAS",
        "library": None,
        "source": "mlx-cpu wheel",
    }
    monkeypatch.setattr(sys, "platform", "darwin")
    assert blas_report()["blas"] == "Accelerate"


# -- one real re-exec -----------------------------------------------------------------------

PROBE = textwrap.dedent(
    """
    import os, sys
    from engine.platform.openblas import blas_report, maybe_reexec_with_openblas, reexec_notice

    print("START", flush=True)
    maybe_reexec_with_openblas(sys.argv, enabled=True, log=lambda line: print("LOG", line))
    print("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    print("NOTICE", reexec_notice())
    print("ARGS", sys.argv[1:])
    print("BLAS", blas_report()["blas"])
    """
)


@pytest.mark.parametrize("launch", ["script", "module"])
def test_real_reexec_happens_exactly_once(tmp_path: Path, launch: str) -> None:
    clean_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(engine.__file__).parents[1]}",
        # The mechanism is under test, not backend detection on this host.
        openblas.BACKEND_ENV: "cpu",
    }
    library = _system_openblas()
    if library is None:
        pytest.skip(
            "OpenBLAS is absent on this machine: no /usr/lib/<multiarch>/openblas-pthread/"
            "libblas.so.3 (Debian package libopenblas0-pthread)"
        )
    (tmp_path / "reexec_probe.py").write_text(PROBE)
    target = ["-m", "reexec_probe"] if launch == "module" else [str(tmp_path / "reexec_probe.py")]
    result = subprocess.run(
        [sys.executable, *target, "--flag", "x y"],
        env=clean_env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = result.stdout.splitlines()
    assert lines.count("START") == 2, result.stdout  # the original process, then one re-exec
    assert [line for line in lines if line.startswith("LOG")] == [
        f"LOG OpenBLAS preloaded from {library} (re-exec)"
    ]
    assert f"LD_PRELOAD {library}" in lines
    assert f"NOTICE OpenBLAS preloaded from {library} (re-exec)" in lines
    assert "ARGS ['--flag', 'x y']" in lines
    assert "BLAS OpenBLAS" in lines


def _system_openblas() -> Path | None:
    machine_dir = openblas.MULTIARCH.get(openblas.platform.machine().lower())
    if sys.platform != "linux" or machine_dir is None:
        return None
    candidate = Path("/usr/lib") / machine_dir / "openblas-pthread" / "libblas.so.3"
    return candidate if candidate.is_file() else None


# -- slow BLAS: the check, the fix, `semantic doctor` ---------------------------------------------
def test_active_openblas_is_the_preloaded_library_and_only_once_it_is_mapped(
        fake_linux_cpu: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", str(fake_linux_cpu))
    monkeypatch.setattr(openblas, "_mapped_files", lambda: ["/usr/lib/libc.so.6", os.path.realpath(fake_linux_cpu)])
    assert openblas.active_openblas() == fake_linux_cpu and not openblas.slow_blas()
    monkeypatch.setattr(openblas, "_mapped_files", lambda: ["/usr/lib/libc.so.6"])  # the preload failed
    assert openblas.active_openblas() is None and openblas.slow_blas()


def test_the_install_command_is_exact_where_apt_get_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(openblas.os.path, "exists", lambda path: path == "/usr/bin/apt-get")
    monkeypatch.setattr(openblas.os, "geteuid", lambda: 1000)
    assert openblas.install_command() == "sudo apt-get install -y libopenblas0-pthread"
    monkeypatch.setattr(openblas.os, "geteuid", lambda: 0)
    assert openblas.install_command() == "apt-get install -y libopenblas0-pthread"
    monkeypatch.setattr(openblas.os.path, "exists", lambda path: False)
    assert openblas.PATH_ENV in openblas.install_command()


@pytest.mark.parametrize("slow, rate, code", [(True, 2.0, 1), (False, 3.0, 1), (False, 80.0, 0)])
def test_doctor_names_a_slow_blas_and_its_fix(slow: bool, rate: float, code: int, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from engine.settings import Settings
    from semantic_cli import doctor

    monkeypatch.setattr(doctor, "slow_blas", lambda: slow)
    monkeypatch.setattr(doctor, "matmul_gflops", lambda: rate)
    monkeypatch.setattr(doctor, "blas_report", lambda: {"backend": "cpu", "blas": "bundled reference BLAS",
                                                        "library": None, "source": "mlx-cpu wheel"})
    monkeypatch.setattr(doctor, "install_command", lambda: "apt-get install -y libopenblas0-pthread")
    assert doctor.doctor(Settings(cache_dir=tmp_path)) == code
    out = capsys.readouterr().out
    assert f"{rate:.1f} GFLOP/s" in out
    assert ("slow BLAS" in out and "apt-get install -y libopenblas0-pthread" in out) == (code == 1)


@pytest.mark.parametrize("warned_by_reexec", [True, False])
def test_start_up_warns_once_about_a_slow_blas_with_the_fix(warned_by_reexec: bool, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    import engine.platform as platform_module
    from engine.settings import Settings
    from semantic_cli import main as cli

    def reexec(argv, enabled, log, warn=None) -> None:
        if warned_by_reexec:  # OpenBLAS not installed: the re-exec decision says so itself
            (warn or log)("slow BLAS: OpenBLAS not found; ... Install it: apt-get install -y libopenblas0-pthread")

    monkeypatch.setattr(platform_module, "maybe_reexec_with_openblas", reexec)
    monkeypatch.setattr(platform_module, "slow_blas", lambda: True)  # (the preload is off, or did not load)
    monkeypatch.setattr(platform_module, "install_command", lambda: "apt-get install -y libopenblas0-pthread")
    with caplog.at_level("WARNING", logger="semantic.cli"):
        cli._maybe_reexec(Settings(cache_dir=tmp_path))
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith("slow BLAS")
    assert "apt-get install -y libopenblas0-pthread" in warnings[0]
