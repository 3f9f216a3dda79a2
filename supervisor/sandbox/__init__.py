"""The code_interpreter sandbox: Python run in a child process with no
network, no view of the service's state, rlimits and a wall clock, in a
container (a folder that lives until it has been idle too long).

- ``init``: the child's own setup (namespaces, mounts, limits), stdlib only;
- ``runner``: one run from the parent (bounded logs, the wall clock, probe);
- ``containers``: the containers, their files, expiry, the bound on them;
- ``files``: uploads copied in, and a container's files as the API lists them;
- ``outputs``: a run as ``code_interpreter_call`` outputs;
- ``settings``: the sandbox from the service's settings.
"""
