"""The metadata service's index backends, behind the interface in base.py."""
