"""What several test modules share: the servers and receivers they start, the ways they publish
and pull, the websocket helpers, the personas and the contract's field sets. A test module
imports from here and never from another test module; fixtures used across apps are in
tests/conftest.py."""
