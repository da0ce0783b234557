/*
 * client.h - the client end of pagefoldd's control socket: connect, send
 * one request, read the greeting and the one reply.  pagefoldctl and the
 * libvirt hook use it.
 *
 * Owns the connection for the length of one call, nothing after.  Must
 * never wait past the caller's deadline: the libvirt hook runs while
 * libvirt waits for it, and a hook that hangs stalls a VM's start.
 */
#pragma once

#include <glib.h>
#include <json-glib/json-glib.h>

/*
 * Sends request to the control socket at socket_path and returns the
 * reply as parsed (an object holding "return" or "error"; the caller
 * looks).  timeout_ms < 0 waits as long as it takes; otherwise one
 * deadline covers the connect, the greeting and the reply, and a call
 * that runs out fails with G_IO_ERROR_TIMED_OUT (pagefoldd may still
 * carry the command out).  Other failures are PF_ERROR: NOT_FOUND when
 * nothing listens there (no socket, or connection refused), FAILED
 * otherwise.
 */
JsonNode *pf_client_call(const char *socket_path, JsonNode *request, int timeout_ms,
                         GError **error);
