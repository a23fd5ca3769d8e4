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

# every kernel folder ships its sources: the CPU kernels are compiled at first use (an installed package without a
# header its sources include cannot build them)
KERNEL_SOURCES = {name: ["*.cpp", "*.h"] for name in packages if name.startswith("localmoe.kernels.")}
setup(packages=packages, package_dir=MAPPED,
      package_data={"localmoe": ["py.typed"], "localmoe.testing": ["configs/*.json", "configs/*.md"],
                    **KERNEL_SOURCES,
                    "localmoe.kernels.paged_io": ["*.cpp", "*.h", "XXHASH_LICENSE"],
                    "localmoe.ui.web": ["*.js"], "localmoe.ui.tui": ["*.tcss"]})
