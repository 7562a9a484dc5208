"""difforge: latent diffusion stages in JAX, chained through artifacts on GCS or a local folder."""

from setuptools import find_packages, setup

BASE = [
    # The supported range: jax 0.12 on Python 3.12, what TPU images and MaxDiffusion run. Every
    # benchmark and parity figure is measured on 0.12.0.1 (the Makefile's JAX_VERSION: 0.12.1's
    # jaxlib runs CPU bf16 products ~5x slower); an environment that already has any 0.12.x
    # keeps it (tests/foundation/test_packaging.py). A minor release changes XLA's kernels and
    # compile behaviour, so the next one is a decision, not an upgrade. The lower bounds of flax,
    # optax and orbax are the releases tested with it.
    "jax>=0.12,<0.13",
    "flax>=0.12.12",
    "optax>=0.2.8",
    "orbax-checkpoint>=0.12.8",
    "apache-beam[gcp]>=2.77",
    "google-cloud-storage>=3",
    "gcsfs",  # orbax reaches gs:// through etils.epath -> fsspec
    "transformers>=5",
    "huggingface_hub>=1",
    "safetensors>=0.8",
    "tensorflow-cpu>=2.21",
    "datasets>=4",
    "pillow",
    "imageio",
    "imageio-ffmpeg",
    # PyAV: LTX-2 image-to-video re-compresses its conditioning image as one H.264 frame
    # (libx264 at CRF 33, as diffusers' LTX2ImageToVideoPipeline; jaxcore/families/ltx2_image.py)
    "av",
    "tqdm",
    "pyyaml",
    "matplotlib",
    "ml_dtypes",
    "scipy",  # SSIM's Gaussian window (generate's step-cache quality gate)
    "ftfy",  # Wan prompt cleaning, as diffusers does it when ftfy is installed (I2V needs it)
    "qwix>=0.1.8",  # compute.quantization's int8 / fp8 kernels (jaxcore/quantization.py)
]

# Intel oneMKL's GEMM for the dense layers on CPU (jaxcore/kernels/cpu_gemm.py): float32
# products ~10% faster than XLA's own dot. The wheels are Linux/Windows x86_64 only.
MKL = ["mkl>=2025; sys_platform == 'linux' and platform_machine == 'x86_64'"]

TEST = [
    *MKL,  # the MKL path is tested where it can run
    "pytest",
    "torch==2.13.0",  # numerical oracle only (diffusers/transformers PyTorch models)
    "diffusers>=0.42",
    "accelerate",
    "peft",  # diffusers' load_lora_weights: the LoRA oracle
    "gcp-storage-emulator",
    "ruff==0.17.6",
    "scikit-image",  # SSIM / PSNR oracle for the step-cache quality gate
    "opencv-python-headless==5.1.0.95",  # cv2.Canny: the oracle for jaxcore/control_preprocess.py
    "torchao==0.18.0",  # bench/quantization.py: diffusers' model quantized as its users do
]

setup(
    name="difforge",
    version="0.1.0",
    description=__doc__,
    python_requires=">=3.12",
    packages=find_packages(include=["jaxcore*", "stages*", "pipelines*"]),
    package_data={"jaxcore": ["README.md", "kernels/native/*.cc", "kernels/native/*.h"]},
    install_requires=BASE,
    extras_require={
        "test": TEST,
        "mkl": MKL,
        "tpu": ["jax[tpu]>=0.12,<0.13"],
        "gpu": ["jax[cuda12]>=0.12,<0.13"],
        "xpk": ["xpk"],
    },
    entry_points={"console_scripts": ["difforge=pipelines.cli:main"]},
)
