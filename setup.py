"""sglang-mamba-ext: hybrid (KV + SSM) prefix cache and deferred-update spec verify for SGLang 0.5.23."""

from setuptools import find_packages, setup

setup(
    name="sglang-mamba-ext",
    version="0.1.0",
    description=(
        "Plugin for stock SGLang 0.5.23: a radix prefix cache holding attention KV and "
        "SSM state for hybrid models, and a memory-lean speculative-decoding verify."
    ),
    packages=find_packages(include=["sglang_mamba_ext", "sglang_mamba_ext.*"]),
    python_requires=">=3.10",
    install_requires=[
        "sglang==0.5.23",
        "torch==2.14.1",
    ],
    extras_require={
        "test": [
            "pytest",
            "pytest-xdist",  # scripts/run_tests.sh runs two workers
            "hypothesis",
            "fla-core",
            "requests",
            "sglang-router==0.3.2",  # tests/e2e/test_router_replicas.py, test_pd_serving.py
            # mooncake's transfer engine without CUDA: --disaggregation-mode on CPU
            # (tests/e2e/test_pd_serving.py); needs Debian's libibverbs1, libnl-3-200,
            # libnl-route-3-200 (scripts/setup_env.sh installs them).
            "mooncake-transfer-engine-non-cuda==0.3.13.post1",
            # NemotronH_Omni_Reasoning_V3's processor (transformers' Parakeet feature extractor),
            # which its tiny checkpoint's build and SGLang's start-up load
            "librosa",
        ],
        # Prefill/decode disaggregation on a host without CUDA (scripts/serve_cpu_pd.sh).
        # A GPU deployment installs SGLang's own mooncake-transfer-engine instead.
        "pd-cpu": [
            "sglang-router==0.3.2",
            "mooncake-transfer-engine-non-cuda==0.3.13.post1",
        ],
    },
    entry_points={
        # SGLang 0.5.23 loads general plugins from this group in every process it starts
        # (sglang/srt/plugins/__init__.py); register() does nothing visible until
        # --enable-mamba-radix is passed.
        "sglang.srt.plugins": [
            "mamba_radix = sglang_mamba_ext.plugin:register",
        ],
    },
    include_package_data=True,
)
