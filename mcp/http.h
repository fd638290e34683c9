/* http.h: MCP over Streamable HTTP (ignition-mcp --http [ADDR:]PORT). */
#pragma once

/* Checks what --http needs before the backend starts: SPEC ("PORT",
 * "ADDR:PORT" or "[IPV6]:PORT"; ADDR defaults to 127.0.0.1, PORT 0 picks a
 * free one), the tokens file, no other address than loopback without
 * tokens.  0, or -EINVAL with the reason on stderr. */
int http_prepare(const char *spec);
/* Serves MCP on http://ADDR:PORT/mcp until SIGTERM, SIGINT or SIGHUP, then
 * shuts down as the stdio loop does.  Returns the exit status: 2 when it
 * cannot listen (the reason on stderr). */
int http_serve(void);
