"""Generation shared by chat and Responses: tools, output parsing, model profiles, grammar."""
