"""kernels/ and ui/ sit at the top of the repository (beside localmoe/) but install as
localmoe.kernels and localmoe.ui: a bare `kernels` package already exists on PyPI, so
nothing named plain `kernels` or `ui` may land in site-packages."""

from setuptools import find_packages, setup

MAPPED = {"localmoe.kernels": "kernels", "localmoe.ui": "ui"}


def mapped_packages(target: str, folder: str) -> list[str]:
    found = find_packages(include=[folder, f"{folder}.*"])
    return [target + name[len(folder):] for name in found]


packages = find_packages(include=["localmoe", "localmoe.*"])
for target, folder in MAPPED.items():
    packages += mapped_packages(target, folder)

setup(packages=packages, package_dir=MAPPED,
      package_data={"localmoe": ["py.typed"], "localmoe.testing": ["configs/*.json", "configs/*.md"],
                    "localmoe.kernels.mxfp4_moe": ["*.cpp", "*.h"], "localmoe.kernels.dense_gemv": ["*.cpp", "*.h"],
                    "localmoe.kernels.dense_moe": ["*.cpp"],
                    "localmoe.kernels.ggml_gemv": ["*.cpp", "*.h"], "localmoe.kernels.decode_layers": ["*.cpp", "*.h"],
                    "localmoe.kernels.gqa_decode": ["*.cpp"], "localmoe.kernels.rms_norm": ["*.cpp"],
                    "localmoe.kernels.paged_io": ["*.cpp", "*.h", "XXHASH_LICENSE"],
                    "localmoe.kernels._cpu": ["*.h"], "localmoe.ui.web": ["*.js"],
                    "localmoe.ui.tui": ["*.tcss"]})  # the CPU kernels are compiled at first use
