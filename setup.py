"""Build of the private C extension moestream._C (everything else is in pyproject.toml)."""

from setuptools import Extension, setup

SOURCES = [
    "csrc/module.c",
    "csrc/attention.c",
    "csrc/gemm_f32.c",
    "csrc/kda.c",
    "csrc/combine_rows.c",
    "csrc/moe_combine.c",
    "csrc/moe_decode.c",
    "csrc/activations.c",
    "csrc/norm.c",
    "csrc/rope.c",
    "csrc/io.c",
    "csrc/crc32c.c",
    "csrc/mapguard.c",
    "csrc/matmul.c",
    "csrc/threadpool.c",
    "csrc/quant_float.c",
    "csrc/quant_float_avx2.c",
    "csrc/quant_float_avx512.c",
    "csrc/quant_blocks.c",
    "csrc/quant_int8.c",
    "csrc/quant_int8_avx2.c",
    "csrc/quant_int8_avx512.c",
    "csrc/quant_mxfp4_vbmi.c",
    "csrc/quant_amx.c",
]

setup(
    ext_modules=[
        Extension(
            "moestream._C",
            sources=SOURCES,
            depends=[
                "csrc/activations.h",
                "csrc/attention.h",
                "csrc/exp_f32.h",
                "csrc/gemm_f32.h",
                "csrc/kda.h",
                "csrc/norm.h",
                "csrc/rope.h",
                "csrc/io.h",
                "csrc/crc32c.h",
                "csrc/mapguard.h",
                "csrc/quant.h",
                "csrc/quant_int8.h",
                "csrc/quant_int8_simd.h",
                "csrc/quant_mxfp4_avx512.h",
                "csrc/matmul.h",
                "csrc/threadpool.h",
                "csrc/quant_float_simd.h",
            ],
            extra_compile_args=["-std=c11", "-O3", "-Wall", "-Wextra", "-ffp-contract=off", "-pthread"],
            extra_link_args=["-pthread", "-lm"],
        )
    ]
)
