"""Build script for flash_attn_tq.

The Python package is always installed.  The CUDA extension
``flash_attn_tq_cuda`` is added only when all of these hold:

* ``FLASH_ATTN_TQ_SKIP_CUDA_BUILD`` is not set to ``1``/``TRUE``;
* the installed torch is a CUDA build (``torch.version.cuda`` is not None);
* ``nvcc`` exists under ``$CUDA_HOME/bin`` (``CUDA_HOME`` defaults to
  ``/usr/local/cuda`` when that directory exists and the variable is unset);
* the kernel sources under ``csrc/flash_attn`` are present.

Otherwise a single message explains why, and the package falls back to its
reference (PyTorch) implementation at run time.

Architectures: ``FLASH_ATTN_TQ_CUDA_ARCHS`` when set; otherwise ``80;90a``
where torch sees a CUDA GPU at build time, and ``90a`` alone where it sees
none (a CPU-only machine, where the extension can never run: the build is
then only a compile check, as in CI).  Compile times on 2 CPU cores: about
10 minutes for ``90a``, 24.7 minutes for ``80;90a``.  A build without a
visible GPU says so, with how to skip it (``FLASH_ATTN_TQ_SKIP_CUDA_BUILD=1``).

Install torch, setuptools, wheel and ninja first, then this package with
``pip install -v --no-build-isolation .`` (``.[test]`` adds what the tests
import), so that the extension is compiled against the torch that is already
installed; ``-v`` shows ninja's ``[n/N]`` line as each source file is compiled.

Environment variables:

``FLASH_ATTN_TQ_SKIP_CUDA_BUILD``  ``1``/``TRUE`` installs Python-only.
``FLASH_ATTN_TQ_CUDA_ARCHS``       target architectures, ``;`` or ``,``
                                   separated (default ``80;90a``, or
                                   ``90a`` without a visible GPU); e.g.
                                   ``90a`` gives compute_90a/sm_90a (Hopper's
                                   wgmma prefill kernel: only with ``90a``;
                                   plain ``90`` runs the mma.sync one) and a
                                   ``+PTX`` suffix also embeds PTX.
``FLASH_ATTN_TQ_CXX_STD``          override the C++ standard (``c++17`` or
                                   ``c++20``); by default the one the
                                   installed torch headers need.
``MAX_JOBS``                       parallel compile jobs (ninja).
``CUDA_HOME``                      CUDA toolkit root.
"""

import glob
import os
import re
import sys
import time

from setuptools import find_packages, setup

VERSION = "0.1.0"
PACKAGE_NAME = "flash_attn_tq"
EXT_NAME = "flash_attn_tq_cuda"
DEFAULT_ARCHS = "80;90a"
NO_GPU_ARCHS = "90a"  # the default where no GPU is visible at build time: a compile check
# compile times on 2 CPU cores (MAX_JOBS=2), in minutes
BUILD_MINUTES = {"90a": "about 10", "80;90a": "24.7"}

THIS_DIR = os.path.dirname(os.path.abspath(__file__))
# Source paths below are relative to the project root (setuptools expects
# relative paths); make that hold even when setup.py is run from elsewhere.
os.chdir(THIS_DIR)
CSRC_DIR = os.path.join("csrc", "flash_attn")
KERNEL_DIR = os.path.join(CSRC_DIR, "src")


def _env_flag(name):
    return os.environ.get(name, "").strip().upper() in ("1", "TRUE")


def _parse_archs(spec):
    """Turn '80;90a,100+PTX' into nvcc -gencode arguments."""
    flags = []
    tokens = [t.strip() for t in re.split(r"[;,\s]+", spec) if t.strip()]
    if not tokens:
        raise ValueError("FLASH_ATTN_TQ_CUDA_ARCHS is empty")
    for tok in tokens:
        m = re.fullmatch(r"(?:sm_|compute_)?(\d+)\.?(\d*)([a-z]?)(\+ptx)?", tok.lower())
        if m is None:
            raise ValueError(
                "FLASH_ATTN_TQ_CUDA_ARCHS: cannot parse architecture %r (expected e.g. 80, 90, 90a, 100+PTX)" % tok
            )
        arch = m.group(1) + m.group(2) + m.group(3)
        flags += ["-gencode", "arch=compute_%s,code=sm_%s" % (arch, arch)]
        if m.group(4):
            flags += ["-gencode", "arch=compute_%s,code=compute_%s" % (arch, arch)]
    return flags


def _cuda_archs(env, gpu_visible):
    """(architectures to build, a note to print or None) from the environment and whether torch
    sees a CUDA GPU at build time."""
    spec = env.get("FLASH_ATTN_TQ_CUDA_ARCHS", "").strip()
    if spec:
        return spec, None
    if gpu_visible:
        return DEFAULT_ARCHS, None
    return NO_GPU_ARCHS, (
        "no CUDA GPU is visible at build time and FLASH_ATTN_TQ_CUDA_ARCHS is not set, so the "
        "extension is compiled for %s only (%s minutes on 2 CPU cores; %s would take %s minutes): here it is a "
        "compile check, as the kernels cannot run on this machine. FLASH_ATTN_TQ_SKIP_CUDA_BUILD=1 "
        "skips the build (Python-only install, reference path); set FLASH_ATTN_TQ_CUDA_ARCHS (e.g. %s) "
        "to build for the GPUs the package will run on"
        % (NO_GPU_ARCHS, BUILD_MINUTES[NO_GPU_ARCHS], DEFAULT_ARCHS, BUILD_MINUTES[DEFAULT_ARCHS], DEFAULT_ARCHS)
    )


def _gpu_visible(torch):
    try:
        return torch.cuda.device_count() > 0
    except Exception:  # a driver that cannot be queried: no usable GPU
        return False


def _cxx_standard(torch_include_dirs):
    """The C++ standard to compile with.

    Older torch releases build with C++17; recent ones (2.10+) refuse anything
    below C++20 in their headers (ATen/ATen.h has an #error for it), so follow
    what the installed headers ask for.
    """
    override = os.environ.get("FLASH_ATTN_TQ_CXX_STD", "").strip()
    if override:
        return override if override.startswith("c++") else "c++" + override
    for inc in torch_include_dirs:
        header = os.path.join(inc, "ATen", "ATen.h")
        if os.path.isfile(header):
            with open(header, encoding="utf-8", errors="replace") as f:
                if "202002L" in f.read(4096):
                    return "c++20"
            break
    return "c++17"


def _glob_relative(pattern):
    """Sorted matches of a pattern under the project root, as relative paths."""
    matches = glob.glob(os.path.join(THIS_DIR, pattern))
    return sorted(os.path.relpath(p, THIS_DIR) for p in matches)


def _extension_plan():
    """Return (ext_modules, cmdclass, reason_if_skipped)."""
    if _env_flag("FLASH_ATTN_TQ_SKIP_CUDA_BUILD"):
        return [], {}, "FLASH_ATTN_TQ_SKIP_CUDA_BUILD is set"

    # torch.utils.cpp_extension resolves CUDA_HOME when it is imported, and a
    # wrapper script such as /usr/local/bin/nvcc would make it guess
    # /usr/local.  Pin the default before that import.
    if not os.environ.get("CUDA_HOME") and os.path.isdir("/usr/local/cuda"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"

    try:
        import torch
    except ImportError:
        return (
            [],
            {},
            ("torch is not importable at build time (install torch first and use `pip install --no-build-isolation`)"),
        )
    if torch.version.cuda is None:
        return [], {}, "the installed torch (%s) is not a CUDA build" % torch.__version__

    cuda_home = os.environ.get("CUDA_HOME", "")
    nvcc = os.path.join(cuda_home, "bin", "nvcc") if cuda_home else ""
    if not (nvcc and os.path.isfile(nvcc) and os.access(nvcc, os.X_OK)):
        where = "$CUDA_HOME/bin/nvcc (CUDA_HOME=%s)" % cuda_home if cuda_home else "CUDA_HOME"
        return [], {}, "nvcc was not found via %s" % where

    cpp_sources = _glob_relative(os.path.join(CSRC_DIR, "*.cpp"))
    cu_sources = _glob_relative(os.path.join(KERNEL_DIR, "*.cu"))
    if not cpp_sources:
        return [], {}, "no C++ sources were found in %s/*.cpp" % CSRC_DIR

    from torch.utils.cpp_extension import BuildExtension, CUDAExtension, include_paths

    std = _cxx_standard(include_paths())
    nvcc_flags = [
        "-O3",
        "-std=" + std,
        "--use_fast_math",
        "-lineinfo",
        "--expt-relaxed-constexpr",
        "-U__CUDA_NO_HALF_OPERATORS__",
        "-U__CUDA_NO_HALF_CONVERSIONS__",
        "-U__CUDA_NO_HALF2_OPERATORS__",
        "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    ]
    archs, note = _cuda_archs(os.environ, _gpu_visible(torch))
    nvcc_flags += _parse_archs(archs)
    # sm_90a code holds the prefill kernel's wgmma variant; the host launches it only then
    defines = ["-DFLASH_TQ_SM90A"] if "arch=compute_90a,code=sm_90a" in nvcc_flags else []
    nvcc_flags += defines

    ext = CUDAExtension(
        name=EXT_NAME,
        sources=cpp_sources + cu_sources,
        include_dirs=[os.path.join(THIS_DIR, CSRC_DIR), os.path.join(THIS_DIR, KERNEL_DIR)],
        extra_compile_args={"cxx": ["-O3", "-std=" + std] + defines, "nvcc": nvcc_flags},
    )
    cmdclass = {"build_ext": _progress_build_ext(BuildExtension.with_options(use_ninja=True), archs, note)}
    return [ext], cmdclass, None


def _progress_build_ext(base, archs, note=None):
    """A build_ext that says what it is about to compile and how long it took.

    ninja numbers each compiled file ([n/N] lines on stdout; pip shows them with ``-v``), so a
    build of several minutes is visibly moving; this adds a line before and after it (and
    ``note``, :func:`_cuda_archs`'s word on a default chosen without a visible GPU, before).
    """

    class BuildExtWithProgress(base):
        def build_extensions(self):
            n = sum(len(ext.sources) for ext in self.extensions)
            jobs = os.environ.get("MAX_JOBS", "ninja's default")
            if note:
                print("flash_attn_tq: " + note, flush=True)
            print(
                "flash_attn_tq: compiling %d source files of %s for CUDA archs %s with MAX_JOBS=%s "
                "(on 2 cores: %s minutes for %s, %s minutes for %s; more cores are faster; "
                "FLASH_ATTN_TQ_SKIP_CUDA_BUILD=1 skips the build); ninja prints [n/N] as each file is compiled"
                % (
                    n,
                    EXT_NAME,
                    archs,
                    jobs,
                    BUILD_MINUTES[NO_GPU_ARCHS],
                    NO_GPU_ARCHS,
                    BUILD_MINUTES[DEFAULT_ARCHS],
                    DEFAULT_ARCHS,
                ),
                flush=True,
            )
            start = time.time()
            super().build_extensions()
            print("flash_attn_tq: %s built in %.0f s" % (EXT_NAME, time.time() - start), flush=True)

    return BuildExtWithProgress


def _metadata_only():
    """True for the metadata passes pip runs before the real build.

    pip invokes setup.py several times per install (egg_info / dist_info for
    metadata, then bdist_wheel or editable_wheel); stay quiet in the metadata
    passes so the skip message appears once per install.
    """
    args = set(sys.argv[1:])
    return bool(args & {"egg_info", "dist_info"}) and not (
        args
        & {
            "build",
            "build_ext",
            "bdist_wheel",
            "editable_wheel",
            "install",
            "develop",
            "bdist_egg",
            "sdist",
        }
    )


ext_modules, cmdclass, skip_reason = _extension_plan()
if skip_reason is not None and not _metadata_only():
    print(
        "flash_attn_tq: not building the CUDA extension %s because %s; installing "
        "the Python package only, and the reference (PyTorch) path will be used." % (EXT_NAME, skip_reason),
        file=sys.stderr,
    )


def _long_description():
    path = os.path.join(THIS_DIR, "README.md")
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return ""


setup(
    name=PACKAGE_NAME,
    version=VERSION,
    description=(
        "FlashAttention-2 fork with decode kernels over a 3-bit quantized KV cache; drop-in for `import flash_attn`"
    ),
    long_description=_long_description(),
    long_description_content_type="text/markdown",
    license="BSD-3-Clause",
    packages=find_packages(include=[PACKAGE_NAME, PACKAGE_NAME + ".*"]),
    python_requires=">=3.10",  # torch 2.14 needs Python 3.10 or newer
    install_requires=["torch"],
    extras_require={
        # flash_attn_tq.integrations (TQCache, calibration, GraphDecoder) and the attention
        # functions of flash_attn_tq.qat
        "transformers": ["transformers>=5"],
        # what `python -m pytest tests` imports: numpy / scipy (quantizer statistics), hypothesis
        # (format properties), transformers (the TQCache integration tests; pinned to the version
        # they are written against), einops (upstream flash-attn's own test file, run against this
        # package), accelerate (transformers' tensor parallelism, in the two-process CPU test)
        "test": ["pytest", "hypothesis", "numpy", "scipy", "einops", "transformers==5.17.0", "accelerate"],
        "upstream": ["flash-attn"],
        # benchmarks/: triton's do_bench timings (also the self-check's on a GPU), plots, and the
        # model benchmarks' transformers
        "bench": ["triton", "matplotlib", "transformers>=5"],
    },
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
