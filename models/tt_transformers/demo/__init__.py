# SPDX-License-Identifier: Apache-2.0
# Shared with a tt-metal checkout's folder of the same name: this package's path takes in every such folder on
# sys.path, so models.tt_transformers.tt (tt-metal's) imports beside ours whether tt-metal's folders are regular or
# namespace packages, as long as this repository comes first on the path (the demo puts itself first when run).
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
