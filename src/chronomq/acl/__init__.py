"""RocketMQ ACL 1.0: plain_acl.yml accounts (plain.py) and the check of each request (validator.py);
ACL 2.0: users and ACLs (auth2.py), their check (validator2.py) and its start (setup.py)."""

from .plain import AclConfigError, PlainAcl, parse
from .validator import AclError, AclValidator, refusal, resources

__all__ = ["AclConfigError", "AclError", "AclValidator", "PlainAcl", "parse", "refusal", "resources"]
