#!/usr/bin/env python
"""A throwaway Django project that uses mqclient.django, as a user's project would
(tests/clients/test_client_django.py runs it in subprocesses)."""

import os
import sys

if __name__ == "__main__":
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqshop.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
