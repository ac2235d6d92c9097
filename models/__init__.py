# SPDX-License-Identifier: Apache-2.0
# Here for a checkout on sys.path only: pip installs no models/__init__.py (pyproject.toml packages models.* alone), so
# an installed `models` is a namespace package that neither replaces nor is replaced by another distribution's file.
# In a checkout this regular package takes in every other `models` folder on sys.path (tt-metal's are namespace
# folders; a regular one, another project's, is taken in when this checkout comes first: README, "Next to tt-metal").
__path__ = __import__("pkgutil").extend_path(__path__, __name__)
