"""Write the DaemonSet's config file from the built-in defaults, or check that it is current.

    python tools/gen_daemonset_config.py          # write daemonset/base/config.yaml
    python tools/gen_daemonset_config.py --check  # exit 1 if it or the README's copy is stale

daemonset/base/config.yaml becomes the ConfigMap the DaemonSet mounts (configMapGenerator), so
a fresh install runs with exactly the defaults, each key commented, but for `nodeLabels.file`,
set to the node feature file's name: it is `deviceplugin.config.default_config_yaml()` with that
name, byte for byte, and daemonset/README.md quotes it between two markers; tests/deploy checks
both. daemonset/components/mps/config.yaml is the same with mps.enabled: true, for the MPS
component. Both are written from the config keys' declarations (deviceplugin/config/model.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from deviceplugin.config import NFD_FEATURE_NAME, Config, MpsConfig, NodeLabelsConfig
from deviceplugin.config.defaults import config_yaml

# The DaemonSet's config: the built-in defaults, with the node feature file named.
DAEMONSET = replace(Config(), node_labels=NodeLabelsConfig(file=NFD_FEATURE_NAME))

DEPLOY = Path(__file__).resolve().parent.parent / "daemonset"
CONFIG = DEPLOY / "base" / "config.yaml"
MPS_CONFIG = DEPLOY / "components" / "mps" / "config.yaml"
README = DEPLOY / "README.md"
BEGIN = "<!-- default config: written by tools/gen_daemonset_config.py; tests/deploy checks it -->"
END = "<!-- end default config -->"


def readme_with(readme: str, config: str) -> str:
    """The README with `config` as the YAML block between the markers."""
    head, begin, rest = readme.partition(BEGIN + "\n")
    _, end, tail = rest.partition(END)
    if not begin or not end:
        raise ValueError(f"{README} lacks the markers {BEGIN!r} ... {END!r}")
    return f"{head}{begin}```yaml\n{config}```\n{end}{tail}"


def mps_config_yaml() -> str:
    """The MPS component's config: the DaemonSet's (node labels included) with MPS on."""
    return config_yaml(replace(DAEMONSET, mps=MpsConfig(enabled=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="write or check daemonset/base/config.yaml")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    config = config_yaml(DAEMONSET)
    readme = README.read_text()
    wanted = {
        CONFIG: config,
        MPS_CONFIG: mps_config_yaml(),
        README: readme_with(readme, config),
    }
    current = {
        path: path.read_text() if path.exists() else None for path in (CONFIG, MPS_CONFIG)
    } | {README: readme}
    stale = [path for path in wanted if current[path] != wanted[path]]
    if args.check:
        for path in stale:
            print(f"{path} is stale: run python tools/gen_daemonset_config.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(wanted[path])
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
