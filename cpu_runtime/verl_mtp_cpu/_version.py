# the product's release (verl_mtp_plugin/_version.py): the two distributions are released together
# (tests/test_wheel.py checks that they agree, and that pyproject.toml pins verl-mtp-plugin to it)
__version__ = "0.1.0"
