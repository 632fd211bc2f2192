/*
 * vgpu-hook: the OCI createRuntime hook through which the vgpu daemon sets a container's GPU
 * memory limits before the container's first instruction (docs/design.md section 15).
 *
 *   vgpu-hook apply --id GRANT [--socket PATH] [--timeout-ms N]
 *   vgpu-hook --version
 *
 * The runtime runs it in the host's namespaces once the container's init process exists in its
 * cgroup, and before that process executes the container's program, with the container's OCI
 * state (JSON) on stdin. The hook reads the state's top-level "pid" and nothing else (never the
 * container's environment, annotations or bundle), sends
 *
 *   VGPU-HOOK 1 apply <pid> <GRANT>\n
 *
 * to the daemon's root-only unix socket (default /run/vgpu/hook.sock), and waits for one line:
 * "OK ..." (exit 0) or "ERR <reason>" (the reason on stderr, exit 1). A daemon that cannot be
 * reached, that answers nothing, or anything that takes longer than the timeout (default 10000
 * ms, for the whole run) fails the hook too: the runtime then does not start the container, and
 * the reason is the container's error. GRANT is the allocation or claim ID the daemon wrote into
 * the CDI spec that carries this hook: 1 to 256 of A-Za-z0-9._:=-.
 *
 * Exit status: 0 applied; 1 refused, failed, unreachable or timed out; 2 a usage error or a
 * state that cannot be read. Built static (gcc -static), so that it needs nothing on the host.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#define VERSION "1"
#define DEFAULT_SOCKET "/run/vgpu/hook.sock"
#define DEFAULT_TIMEOUT_MS 10000L
#define MAX_STATE_BYTES (1 << 20)
#define MAX_ANSWER_BYTES 4096
#define MAX_GRANT_CHARS 256
#define MAX_PID (1L << 22)
#define MAX_DEPTH 64

static const char *volatile stage = "starting";

static void say(const char *text) {
    size_t left = strlen(text);
    while (left > 0) {
        ssize_t n = write(STDERR_FILENO, text, left);
        if (n <= 0) {
            return;
        }
        text += n;
        left -= (size_t)n;
    }
}

static void on_alarm(int signo) {
    (void)signo;
    say("vgpu-hook: timed out while ");
    say(stage);
    say("; the container's GPU memory limit cannot be confirmed, so it is not started\n");
    _exit(1);
}

__attribute__((format(printf, 2, 3))) static int fail(int status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "vgpu-hook: ");
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    return status;
}

/* ---- the OCI state: a bounded JSON scan for the top-level "pid" ---------------------------- */

struct scan {
    const char *p;
    const char *end;
};

static void skip_space(struct scan *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r')) {
        s->p++;
    }
}

/* A string at s->p (the opening quote); its raw content (escapes left as they are). */
static int scan_string(struct scan *s, const char **start, size_t *length) {
    if (s->p >= s->end || *s->p != '"') {
        return -1;
    }
    s->p++;
    *start = s->p;
    while (s->p < s->end && *s->p != '"') {
        if ((unsigned char)*s->p < 0x20) {
            return -1;
        }
        if (*s->p == '\\') {
            s->p++;
            if (s->p >= s->end) {
                return -1;
            }
        }
        s->p++;
    }
    if (s->p >= s->end) {
        return -1;
    }
    *length = (size_t)(s->p - *start);
    s->p++;
    return 0;
}

/* Skip one value of any kind, nested at most MAX_DEPTH deep. */
static int skip_value(struct scan *s, int depth) {
    const char *start;
    size_t length;
    skip_space(s);
    if (s->p >= s->end || depth > MAX_DEPTH) {
        return -1;
    }
    if (*s->p == '"') {
        return scan_string(s, &start, &length);
    }
    if (*s->p == '{' || *s->p == '[') {
        char close = *s->p == '{' ? '}' : ']';
        int object = *s->p == '{';
        s->p++;
        skip_space(s);
        if (s->p < s->end && *s->p == close) {
            s->p++;
            return 0;
        }
        for (;;) {
            if (object) {
                skip_space(s);
                if (scan_string(s, &start, &length) != 0) {
                    return -1;
                }
                skip_space(s);
                if (s->p >= s->end || *s->p != ':') {
                    return -1;
                }
                s->p++;
            }
            if (skip_value(s, depth + 1) != 0) {
                return -1;
            }
            skip_space(s);
            if (s->p < s->end && *s->p == ',') {
                s->p++;
                continue;
            }
            if (s->p < s->end && *s->p == close) {
                s->p++;
                return 0;
            }
            return -1;
        }
    }
    /* A number or a literal: the characters they are made of. */
    const char *before = s->p;
    while (s->p < s->end && strchr("0123456789+-.eEtrufalsn", *s->p) != NULL) {
        s->p++;
    }
    return s->p > before ? 0 : -1;
}

/* The top-level "pid" of the state; -1 when missing, repeated, not a positive integer, or when
 * the text is not one JSON object. */
static long state_pid(const char *text, size_t size) {
    struct scan s = {text, text + size};
    long pid = -1;
    int seen = 0;
    skip_space(&s);
    if (s.p >= s.end || *s.p != '{') {
        return -1;
    }
    s.p++;
    skip_space(&s);
    if (s.p < s.end && *s.p == '}') {
        return -1;
    }
    for (;;) {
        const char *key;
        size_t length;
        skip_space(&s);
        if (scan_string(&s, &key, &length) != 0) {
            return -1;
        }
        skip_space(&s);
        if (s.p >= s.end || *s.p != ':') {
            return -1;
        }
        s.p++;
        skip_space(&s);
        if (length == 3 && memcmp(key, "pid", 3) == 0) {
            long value = 0;
            const char *digits = s.p;
            if (seen++) {
                return -1;
            }
            while (s.p < s.end && *s.p >= '0' && *s.p <= '9' && value < MAX_PID) {
                value = value * 10 + (*s.p - '0');
                s.p++;
            }
            if (s.p == digits || *digits == '0' || value <= 0 || value >= MAX_PID) {
                return -1;
            }
            if (s.p < s.end && strchr(".eE", *s.p) != NULL) {
                return -1;
            }
            pid = value;
        } else if (skip_value(&s, 1) != 0) {
            return -1;
        }
        skip_space(&s);
        if (s.p < s.end && *s.p == ',') {
            s.p++;
            continue;
        }
        if (s.p < s.end && *s.p == '}') {
            s.p++;
            skip_space(&s);
            return s.p == s.end ? pid : -1;
        }
        return -1;
    }
}

static char *read_state(size_t *size) {
    char *buffer = malloc(MAX_STATE_BYTES + 1);
    size_t used = 0;
    if (buffer == NULL) {
        return NULL;
    }
    for (;;) {
        ssize_t n = read(STDIN_FILENO, buffer + used, MAX_STATE_BYTES + 1 - used);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0) {
            free(buffer);
            return NULL;
        }
        if (n == 0) {
            break;
        }
        used += (size_t)n;
        if (used > MAX_STATE_BYTES) {
            free(buffer);
            errno = EFBIG;
            return NULL;
        }
    }
    *size = used;
    return buffer;
}

/* ---- the daemon ------------------------------------------------------------------------------ */

static int valid_grant(const char *grant) {
    size_t n = strlen(grant);
    if (n == 0 || n > MAX_GRANT_CHARS) {
        return 0;
    }
    for (const char *c = grant; *c; c++) {
        if (!((*c >= 'A' && *c <= 'Z') || (*c >= 'a' && *c <= 'z') || (*c >= '0' && *c <= '9') ||
              strchr("._:=-", *c) != NULL)) {
            return 0;
        }
    }
    return 1;
}

static int send_all(int fd, const char *data, size_t length) {
    while (length > 0) {
        ssize_t n = send(fd, data, length, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n <= 0) {
            return -1;
        }
        data += n;
        length -= (size_t)n;
    }
    return 0;
}

static int ask_daemon(const char *socket_path, long pid, const char *grant) {
    struct sockaddr_un address;
    char request[64 + MAX_GRANT_CHARS];
    char reply[MAX_ANSWER_BYTES + 1];
    size_t got = 0;
    int fd;

    memset(&address, 0, sizeof address);
    address.sun_family = AF_UNIX;
    if (strlen(socket_path) >= sizeof address.sun_path) {
        return fail(2, "the socket path %s is too long for a unix socket", socket_path);
    }
    strcpy(address.sun_path, socket_path);
    stage = "connecting to the vgpu daemon";
    fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&address, sizeof address) != 0) {
        return fail(1,
                    "cannot reach the vgpu daemon at %s: %s; the container's GPU memory limit "
                    "cannot be applied, so it is not started (is the vgpu daemon running on this "
                    "node?)",
                    socket_path, strerror(errno));
    }
    snprintf(request, sizeof request, "VGPU-HOOK 1 apply %ld %s\n", pid, grant);
    stage = "sending the request to the vgpu daemon";
    /* A daemon that refuses may answer and close before all was sent: its answer is read all
     * the same, and the send's error is reported only when there is none. */
    int send_error = send_all(fd, request, strlen(request)) != 0 ? errno : 0;
    shutdown(fd, SHUT_WR);
    stage = "waiting for the vgpu daemon's answer";
    for (;;) {
        ssize_t n = recv(fd, reply + got, MAX_ANSWER_BYTES - got, 0);
        if (n < 0 && errno == EINTR) {
            continue;
        }
        if (n < 0 && got == 0 && send_error != 0) {
            return fail(1, "cannot send to the vgpu daemon at %s: %s", socket_path,
                        strerror(send_error));
        }
        if (n < 0) {
            return fail(1, "reading the vgpu daemon's answer failed: %s", strerror(errno));
        }
        if (n == 0 || got + (size_t)n >= MAX_ANSWER_BYTES) {
            got += (size_t)(n > 0 ? n : 0);
            break;
        }
        got += (size_t)n;
    }
    close(fd);
    reply[got] = '\0';
    char *newline = strchr(reply, '\n');
    if (newline == NULL && send_error != 0) {
        return fail(1, "cannot send to the vgpu daemon at %s: %s", socket_path,
                    strerror(send_error));
    }
    if (newline == NULL) {
        return fail(1, "the vgpu daemon at %s closed the connection without an answer",
                    socket_path);
    }
    *newline = '\0';
    for (char *c = reply; *c; c++) {
        if ((unsigned char)*c < 0x20 || (unsigned char)*c > 0x7e) {
            *c = '?';
        }
    }
    if (strncmp(reply, "OK", 2) == 0 && (reply[2] == ' ' || reply[2] == '\0')) {
        return 0;
    }
    if (strncmp(reply, "ERR ", 4) == 0) {
        return fail(1, "the vgpu daemon refused the container's GPU memory limit: %s",
                    reply + 4);
    }
    return fail(1, "unexpected answer from the vgpu daemon: %s", reply);
}

/* ---- main -------------------------------------------------------------------------------------- */

static int usage(void) {
    fprintf(stderr, "usage: vgpu-hook apply --id GRANT [--socket PATH] [--timeout-ms N]\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *grant = NULL;
    const char *socket_path = DEFAULT_SOCKET;
    long timeout_ms = DEFAULT_TIMEOUT_MS;

    if (argc == 2 && strcmp(argv[1], "--version") == 0) {
        printf("vgpu-hook %s\n", VERSION);
        return 0;
    }
    if (argc < 2 || strcmp(argv[1], "apply") != 0) {
        return usage();
    }
    for (int i = 2; i < argc; i += 2) {
        if (i + 1 >= argc) {
            return usage();
        }
        if (strcmp(argv[i], "--id") == 0) {
            grant = argv[i + 1];
        } else if (strcmp(argv[i], "--socket") == 0) {
            socket_path = argv[i + 1];
        } else if (strcmp(argv[i], "--timeout-ms") == 0) {
            char *end;
            errno = 0;
            timeout_ms = strtol(argv[i + 1], &end, 10);
            if (errno != 0 || *end != '\0' || timeout_ms <= 0 || timeout_ms > 600000) {
                return fail(2, "--timeout-ms takes milliseconds from 1 to 600000, got %s",
                            argv[i + 1]);
            }
        } else {
            return usage();
        }
    }
    if (grant == NULL || !valid_grant(grant)) {
        return fail(2, "--id takes 1 to 256 of A-Za-z0-9._:=-, got %s",
                    grant == NULL ? "nothing" : grant);
    }

    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_alarm;
    sigaction(SIGALRM, &action, NULL);
    struct itimerval timer = {{0, 0}, {timeout_ms / 1000, (timeout_ms % 1000) * 1000}};
    setitimer(ITIMER_REAL, &timer, NULL);

    stage = "reading the container's state";
    size_t size = 0;
    char *state = read_state(&size);
    if (state == NULL) {
        return fail(2, "cannot read the container's state on stdin: %s", strerror(errno));
    }
    long pid = state_pid(state, size);
    free(state);
    if (pid <= 0) {
        return fail(2, "the container's state on stdin has no valid top-level \"pid\"");
    }
    return ask_daemon(socket_path, pid, grant);
}
