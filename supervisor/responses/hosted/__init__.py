"""Hosted tools: tools the server runs itself inside one response.

A request's ``mcp`` tools name remote MCP servers. Their tools are listed
(``mcp_list_tools`` items) and offered to the model as functions; a call
the model makes to one is run here (an ``mcp_call`` item with its output),
and the model generates again with the result, until it answers or the
loop's limits end it (:mod:`.loop`). Off until an admin allows server URLs
(``mcp_allowed_urls``); the ``mcp`` SDK is imported only then.
"""
