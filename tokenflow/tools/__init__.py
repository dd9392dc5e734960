"""The tools: the `tokenflow` command, the benches, the load-test client and
the tiny local model. They sit above every other layer and nothing imports
them but tests."""
