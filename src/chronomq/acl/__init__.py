"""RocketMQ ACL 1.0: plain_acl.yml accounts (plain.py) and the check of each request (validator.py)."""

from .plain import AclConfigError, PlainAcl, parse
from .validator import AclError, AclValidator, refusal, resources

__all__ = ["AclConfigError", "AclError", "AclValidator", "PlainAcl", "parse", "refusal", "resources"]
