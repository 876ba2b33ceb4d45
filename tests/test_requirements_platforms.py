"""`pip install -r requirements.txt` resolves on students' laptops: macOS on Apple silicon and
Windows x86_64, Python 3.11, with binary wheels only. Nothing is installed: pip's dry run for a
target platform (`--platform --python-version --only-binary=:all: --target`) picks the wheels a Mac
or a Windows machine would get. Needs the package registry; skipped when it cannot be reached.

requirements.txt is requirements-deps.txt (the pins) plus `-e .` (this repository, which is pure Python
and cannot be resolved for another platform), so the pins are what is resolved here. pip evaluates
environment markers (`; sys_platform == "linux"`, in our pins and in the dependencies' metadata, such
as torch's CUDA packages) against the machine it runs on, not the target platform; the resolution
therefore runs pip with its marker environment set to the target's, as pip on that machine would.
"""

import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

TARGETS = {
    "macos-arm64": (
        "macosx_14_0_arm64",
        {
            "sys_platform": "darwin",
            "platform_system": "Darwin",
            "platform_machine": "arm64",
            "os_name": "posix",
        },
    ),
    "windows-amd64": (
        "win_amd64",
        {"sys_platform": "win32", "platform_system": "Windows", "platform_machine": "AMD64", "os_name": "nt"},
    ),
}
PYTHON = "3.11"

# pip with its marker environment replaced by the target's; argv: target environment (JSON), pip's args
PIP_FOR_TARGET = """
import json, sys
from pip._vendor.packaging import markers
target, host_environment = json.loads(sys.argv[1]), markers.default_environment
markers.default_environment = lambda: {**host_environment(), **target}
from pip._internal.cli.main import main
sys.exit(main(sys.argv[2:]))
"""

NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Max retries exceeded|Temporary failure in name resolution|"
    r"Failed to establish a new connection|ConnectTimeout|Network is unreachable|"
    r"Could not fetch URL"
)


def pinned(requirements: Path) -> dict[str, str]:
    pins = {}
    for line in requirements.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line.strip())
        if match:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def resolve(target: str, tmp_path: Path):
    platform, environment = TARGETS[target]
    environment = dict(
        environment,
        python_version=PYTHON,
        python_full_version=f"{PYTHON}.0",
        implementation_name="cpython",
        platform_python_implementation="CPython",
    )
    report = tmp_path / f"{target}.json"
    command = [
        sys.executable,
        "-c",
        PIP_FOR_TARGET,
        json.dumps(environment),
        "install",
        "--dry-run",
        "--ignore-installed",
        "--only-binary=:all:",
        "--platform",
        platform,
        "--python-version",
        PYTHON,
        "--target",
        str(tmp_path / f"{target}-target"),
        "--report",
        str(report),
        "--quiet",
        "--retries",
        "1",
        "--timeout",
        "30",
        "-r",
        str(ROOT / "requirements-deps.txt"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    return done, report


def test_requirements_txt_is_the_pins_plus_this_package():
    lines = [
        line.strip()
        for line in (ROOT / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    assert lines == ["-r requirements-deps.txt", "-e ."]


def test_requirements_resolve_for_macos_and_windows(tmp_path):
    with ThreadPoolExecutor(len(TARGETS)) as pool:  # two downloads of metadata at once
        results = dict(zip(TARGETS, pool.map(lambda t: resolve(t, tmp_path), TARGETS)))
    for target, (done, _) in results.items():
        if done.returncode != 0 and NETWORK_ERRORS.search(done.stderr):
            pytest.skip(
                f"the package registry cannot be reached, so the {target} resolution cannot run: "
                f"{NETWORK_ERRORS.search(done.stderr).group(0)}"
            )
    pins = pinned(ROOT / "requirements-deps.txt")
    for target, (done, report) in results.items():
        assert done.returncode == 0, (
            f"{target}: pip could not resolve requirements-deps.txt:\n{done.stderr[-4000:]}"
        )
        chosen = {
            item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]
        }
        wheels = [
            item["download_info"]["url"].rsplit("/", 1)[-1]
            for item in json.loads(report.read_text())["install"]
        ]
        assert "triton" not in chosen, f"{target}: triton has no wheels there and must be left out"
        for name, version in pins.items():
            if name != "triton":
                assert chosen.get(name) == version, (
                    f"{target}: {name} resolved to {chosen.get(name)}, pinned {version}"
                )
        assert not [name for name in chosen if name.startswith(("nvidia-", "cuda-"))], (
            f"{target}: CUDA packages"
        )
        torch_wheel = next(w for w in wheels if w.startswith("torch-"))
        assert TARGETS[target][0].split("_")[-1] in torch_wheel, torch_wheel
        print(f"{target}: {len(chosen)} packages, {torch_wheel}")
