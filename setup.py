from setuptools import find_packages, setup

setup(
    name="megatron_fp4",
    version="0.1.0",
    description="MXFP4 token dispatch for Mixture-of-Experts training with Megatron-Core on Hopper GPUs",
    packages=find_packages(include=["megatron_fp4", "megatron_fp4.*"]),
    python_requires=">=3.12",
    install_requires=["torch>=2.11", "triton>=3.6", "megatron-core>=0.18,<0.20", "pyyaml"],
    # The patches for Megatron-LM forks ship inside the package (megatron-fp4 patch finds them there);
    # so do the CUDA C++ sources NVRTC compiles at first use.
    package_data={"megatron_fp4.patching": ["patches/*/*.patch"], "megatron_fp4.kernels": ["sm90/*.cu", "sm90/*.cuh"]},
    entry_points={"console_scripts": ["megatron-fp4 = megatron_fp4.cli:main"]},
    extras_require={
        # The test extra renders the estimator's plot in a test, so it needs the plot extra's matplotlib;
        # pytest-xdist runs the suite on two processes (the README's test command); its --dist
        # loadgroup renames node ids through an attribute pytest 9.2 no longer reads, hence < 9.2.
        "test": ["pytest>=8,<9.2", "pytest-xdist", "numpy", "matplotlib"],
        # `megatron-fp4 estimate --plot FILE.png`.
        "plot": ["matplotlib"],
        # Transformer Engine's PyTorch part builds from source against CUDA; optional.
        "te": ["transformer-engine[pytorch]"],
    },
)
