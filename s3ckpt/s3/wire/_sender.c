/* s3ckpt.s3.wire._sender: a batch of HTTP/1.1 requests whose bodies are in memory, sent
 * and answered by native threads that never take the GIL.
 *
 * A thread-mode save uploads from the trainer's own interpreter. What that costs the
 * training loop is not the bytes (the kernel copies them with the GIL released) but each
 * time an upload thread takes the GIL back: the loop's thread, which lets the GIL go at
 * every torch op, then waits for it. Sent from Python, even the leanest PUT takes the
 * GIL back four or five times (a queue, the head, the body, the answer, the result),
 * each a wait of the training loop's thread beside it. Here the caller hands over a
 * whole batch of signed requests, lets the GIL go once, and takes it back once when
 * every answer is in: a batch's hand-overs no longer grow with its parts. No library
 * sends requests from memory this way: libcurl and awscrt read bodies through Python
 * callbacks, and object_store (obstore) signs and retries on its own terms, outside
 * s3ckpt's retry policy and checksums.
 *
 * Only plain HTTP: requests are signed by the caller, answers are returned raw (head and
 * body) for the caller to parse. Each thread keeps one connection for its requests; a
 * request that fails (refused, reset, stalled past the timeout, an answer this module
 * does not read, such as a chunked one) is reported with its errno and a message, and
 * its connection is closed. A request on a kept-alive connection that the server closed
 * before answering is sent once more on a new one. Setting the first byte of ``cancel``
 * makes the threads skip every request they have not started.
 *
 * The threads run at nice 19, the lowest priority of the normal scheduling class (Linux,
 * where a thread has a nice value of its own; $S3CKPT_SENDER_NICE sets another value, and
 * the process's own keeps them at its priority). They never hold the GIL; the Python
 * threads of a save do, and a holder that a sender thread preempts keeps every other
 * Python thread waiting, the training loop's included, for as long as it stays off the
 * core: at nice 19 the sender does not keep it off (docs/decisions/0003-native-sender.md
 * has the measurement). The normal class never starves a thread: on a core busy with
 * other work the sender still gets its turns.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/resource.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/syscall.h>
#endif

#define MAX_HEAD (64 * 1024)
#define MAX_ANSWER (1024 * 1024)
#define ERR_UNREAD 1000 /* an answer this module does not read (chunked, too large) */

typedef struct {
    Py_buffer head, body;
    int err;             /* 0: answered; an errno (or ERR_UNREAD) otherwise */
    char message[160];   /* what failed, when err != 0 */
    char *answer;        /* the answer's head and body, malloc'd */
    size_t answer_len;
} Job;

typedef struct {
    Job *jobs;
    Py_ssize_t count;
    atomic_long next;
    struct addrinfo *addresses;
    struct timeval connect_timeout, timeout;
    struct timeval send_slice; /* SO_SNDTIMEO: a send call waits at most this long */
    double timeout_s;          /* seconds a request may go without a byte moving */
    volatile const char *cancel;
    int nice; /* the nice value of the batch's threads (sender_nice) */
} Batch;

#define SEND_SLICES 4 /* a send call waits a quarter of the timeout at most */

static int connect_to(Batch *batch, char *message) {
    int last = ECONNREFUSED;
    for (struct addrinfo *a = batch->addresses; a != NULL; a = a->ai_next) {
        int fd = socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
        if (fd < 0) {
            last = errno;
            continue;
        }
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        /* On Linux the send timeout also bounds connect(). */
        setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &batch->connect_timeout,
                   sizeof batch->connect_timeout);
        if (connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
            setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &batch->send_slice, sizeof batch->send_slice);
            setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &batch->timeout, sizeof batch->timeout);
            return fd;
        }
        last = (errno == EINPROGRESS || errno == EAGAIN) ? ETIMEDOUT : errno;
        close(fd);
    }
    snprintf(message, 160, "connect: %s", strerror(last));
    return -last;
}

static double now_s(void) {
    struct timespec at;
    clock_gettime(CLOCK_MONOTONIC, &at);
    return (double)at.tv_sec + (double)at.tv_nsec * 1e-9;
}

/* Sends the head and the body as one stream; 0, or an errno (ETIMEDOUT once no byte has
 * moved for ``timeout_s``). A send call that times out after moving some bytes returns
 * them, having waited its whole timeout: with that timeout the request's own, a body
 * the server stopped reading would take two or three timeouts to fail. So each call waits
 * at most a slice of it (SEND_SLICES), and the silence is what adds up: calls that moved
 * nothing, since the last that moved something. */
static int send_request(int fd, Job *job, double timeout_s) {
    struct iovec vec[2] = {
        {job->head.buf, (size_t)job->head.len},
        {job->body.buf, (size_t)job->body.len},
    };
    struct iovec *at = vec;
    int left = 2;
    double silent_since = now_s();
    while (left > 0) {
        struct msghdr msg = {0};
        msg.msg_iov = at;
        msg.msg_iovlen = (size_t)left;
        ssize_t sent = sendmsg(fd, &msg, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) {
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                return errno;
            }
            if (now_s() - silent_since >= timeout_s) {
                return ETIMEDOUT;
            }
            continue;
        }
        silent_since = now_s();
        while (left > 0 && (size_t)sent >= at->iov_len) {
            sent -= (ssize_t)at->iov_len;
            at++;
            left--;
        }
        if (left > 0) {
            at->iov_base = (char *)at->iov_base + sent;
            at->iov_len -= (size_t)sent;
        }
    }
    return 0;
}

/* The value of header ``name`` (lower case, with its colon) in ``head``, or NULL. */
static const char *header_value(const char *head, size_t len, const char *name) {
    size_t n = strlen(name);
    const char *line = memchr(head, '\n', len);
    while (line != NULL && (size_t)(line + 1 - head) < len) {
        line++;
        size_t rest = len - (size_t)(line - head);
        if (rest > n && strncasecmp(line, name, n) == 0) {
            const char *value = line + n;
            while (*value == ' ' || *value == '\t') {
                value++;
            }
            return value;
        }
        line = memchr(line, '\n', rest);
    }
    return NULL;
}

static int has_token(const char *value, const char *token) {
    if (value == NULL) {
        return 0;
    }
    size_t n = strlen(token);
    for (const char *p = value; *p != '\r' && *p != '\n' && *p != '\0'; p++) {
        if (strncasecmp(p, token, n) == 0) {
            return 1;
        }
    }
    return 0;
}

/* Reads one answer into job->answer; 0, or an errno (ERR_UNREAD for answers not read
 * here). ``*keep`` says whether the connection can carry another request. ``*got`` says
 * whether any byte of an answer arrived. */
static int read_answer(int fd, Job *job, int *keep, int *got) {
    size_t cap = 4096, len = 0, head_len = 0;
    char *buf = malloc(cap);
    if (buf == NULL) {
        return ENOMEM;
    }
    *keep = 0;
    *got = 0;
    size_t want = 0; /* the whole answer's length, once the head is read */
    int until_close = 0;
    for (;;) {
        if (head_len && !until_close && len >= want) {
            break;
        }
        if (len == cap) {
            if (cap >= MAX_ANSWER) {
                free(buf);
                return ERR_UNREAD;
            }
            cap *= 2;
            char *grown = realloc(buf, cap);
            if (grown == NULL) {
                free(buf);
                return ENOMEM;
            }
            buf = grown;
        }
        ssize_t count = recv(fd, buf + len, cap - len, 0);
        if (count < 0 && errno == EINTR) {
            continue;
        }
        if (count < 0) {
            int err = (errno == EAGAIN || errno == EWOULDBLOCK) ? ETIMEDOUT : errno;
            free(buf);
            return err;
        }
        if (count == 0) {
            if (until_close && head_len) {
                break;
            }
            free(buf);
            return ECONNRESET;
        }
        *got = 1;
        len += (size_t)count;
        if (head_len) {
            continue;
        }
        char *end = NULL;
        for (size_t i = 3; i < len; i++) {
            if (buf[i] == '\n' && buf[i - 1] == '\r' && buf[i - 2] == '\n' && buf[i - 3] == '\r') {
                end = buf + i + 1;
                break;
            }
        }
        if (end == NULL) {
            if (len >= MAX_HEAD) {
                free(buf);
                return ERR_UNREAD;
            }
            continue;
        }
        head_len = (size_t)(end - buf);
        if (len < 12 || strncmp(buf, "HTTP/1.", 7) != 0) {
            free(buf);
            return ERR_UNREAD;
        }
        int status = atoi(buf + 9);
        if (status < 200) { /* 100 Continue and the like: not asked for */
            free(buf);
            return ERR_UNREAD;
        }
        if (has_token(header_value(buf, head_len, "transfer-encoding:"), "chunked")) {
            free(buf);
            return ERR_UNREAD;
        }
        const char *length = header_value(buf, head_len, "content-length:");
        int closing = has_token(header_value(buf, head_len, "connection:"), "close") ||
                      strncmp(buf, "HTTP/1.0", 8) == 0;
        if (length != NULL) {
            long long body = atoll(length);
            if (body < 0 || body > MAX_ANSWER) {
                free(buf);
                return ERR_UNREAD;
            }
            want = head_len + (size_t)body;
            *keep = !closing;
        } else if (status == 204 || status == 304) {
            want = head_len;
            *keep = !closing;
        } else {
            until_close = 1; /* the body ends with the connection */
        }
    }
    if (!until_close && len > want) { /* bytes beyond the answer: not ours to guess at */
        *keep = 0;
        len = want;
    }
    job->answer = buf;
    job->answer_len = len;
    return 0;
}

static void fail(Job *job, int err, const char *what) {
    job->err = err;
    if (err == ERR_UNREAD) {
        snprintf(job->message, sizeof job->message, "%s: an answer this sender does not read", what);
    } else {
        snprintf(job->message, sizeof job->message, "%s: %s", what, strerror(err));
    }
}

#define SENDER_NICE 19
#define SENDER_NICE_VARIABLE "S3CKPT_SENDER_NICE"

/* The nice value for a batch's threads: $S3CKPT_SENDER_NICE (-20 to 19), else SENDER_NICE.
 * Read by the calling thread, which holds the GIL (Python changes the environment under it). */
static int sender_nice(void) {
    const char *text = getenv(SENDER_NICE_VARIABLE);
    if (text == NULL || *text == '\0') {
        return SENDER_NICE;
    }
    char *end;
    long value = strtol(text, &end, 10);
    return *end == '\0' && value >= -20 && value <= 19 ? (int)value : SENDER_NICE;
}

/* This thread at nice ``nice`` where that is lower priority than it has: the threads that
 * hold the GIL get the core first where both want it. Raising a nice value needs no
 * privilege; lowering it does, and is not tried. */
static void yield_to_python(int nice) {
#ifdef __linux__
    id_t thread = (id_t)syscall(SYS_gettid);
    errno = 0;
    int now = getpriority(PRIO_PROCESS, thread);
    if (errno == 0 && nice > now) {
        setpriority(PRIO_PROCESS, thread, nice);
    }
#else
    (void)nice;
#endif
}

static void *run_jobs(void *arg) {
    Batch *batch = arg;
    int fd = -1, reused = 0;
    for (;;) {
        long index = atomic_fetch_add(&batch->next, 1);
        if (index >= batch->count) {
            break;
        }
        Job *job = &batch->jobs[index];
        for (int tries = 0;; tries++) {
            if (batch->cancel != NULL && batch->cancel[0]) {
                fail(job, ECANCELED, "request");
                break;
            }
            if (fd < 0) {
                fd = connect_to(batch, job->message);
                if (fd < 0) {
                    job->err = -fd;
                    fd = -1;
                    break;
                }
                reused = 0;
            }
            int keep = 0, got = 0;
            int err = send_request(fd, job, batch->timeout_s);
            const char *what = "send";
            if (err == 0) {
                err = read_answer(fd, job, &keep, &got);
                what = "answer";
            }
            if (err != 0 || !keep) {
                close(fd);
                fd = -1;
            } else {
                reused = 1;
            }
            if (err == 0) {
                break;
            }
            /* A kept-alive connection the server had closed: once more on a new one. */
            int stale = err == EPIPE || err == ECONNRESET;
            if (stale && reused && !got && tries == 0) {
                continue;
            }
            fail(job, err, what);
            break;
        }
        reused = fd >= 0;
    }
    if (fd >= 0) {
        close(fd);
    }
    return NULL;
}


/* A thread of the batch: at nice SENDER_NICE, then the batch's requests. Only threads
 * started here are reniced: the calling thread is a Python thread (a worker of the
 * connection pool's executor, which also holds the GIL for other work), and a nice value
 * once raised cannot be lowered again without privilege, so the caller only waits. */
static void *sender_thread(void *arg) {
    yield_to_python(((Batch *)arg)->nice);
    return run_jobs(arg);
}

static void release_jobs(Job *jobs, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        if (jobs[i].head.obj != NULL) {
            PyBuffer_Release(&jobs[i].head);
        }
        if (jobs[i].body.obj != NULL) {
            PyBuffer_Release(&jobs[i].body);
        }
        free(jobs[i].answer);
    }
    PyMem_Free(jobs);
}

static int take_buffers(PyObject *requests, Job *jobs, Py_ssize_t count) {
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(requests, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "each request is a (head, body) tuple");
            return -1;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 0), &jobs[i].head, PyBUF_C_CONTIGUOUS) < 0 ||
            PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 1), &jobs[i].body, PyBUF_C_CONTIGUOUS) < 0) {
            return -1;
        }
    }
    return 0;
}

static PyObject *results_of(Job *jobs, Py_ssize_t count) {
    PyObject *results = PyList_New(count);
    for (Py_ssize_t i = 0; results != NULL && i < count; i++) {
        PyObject *item = jobs[i].err == 0
            ? Py_BuildValue("(iy#)", 0, jobs[i].answer, (Py_ssize_t)jobs[i].answer_len)
            : Py_BuildValue("(is)", jobs[i].err, jobs[i].message);
        if (item == NULL) {
            Py_CLEAR(results);
            break;
        }
        PyList_SET_ITEM(results, i, item);
    }
    return results;
}

static struct timeval seconds(double value) {
    struct timeval time;
    time.tv_sec = (time_t)value;
    time.tv_usec = (suseconds_t)((value - (double)time.tv_sec) * 1e6);
    return time;
}

static PyObject *exchange(PyObject *self, PyObject *args) {
    const char *host;
    int port, connections;
    double connect_timeout, timeout;
    PyObject *requests_arg, *cancel_arg;
    if (!PyArg_ParseTuple(args, "siOiddO", &host, &port, &requests_arg, &connections,
                          &connect_timeout, &timeout, &cancel_arg)) {
        return NULL;
    }
    if (connections < 1 || connect_timeout <= 0 || timeout <= 0) {
        PyErr_SetString(PyExc_ValueError, "connections must be >= 1 and timeouts > 0");
        return NULL;
    }
    Py_buffer cancel = {0};
    if (cancel_arg != Py_None) {
        if (PyObject_GetBuffer(cancel_arg, &cancel, PyBUF_WRITABLE) < 0) {
            return NULL;
        }
        if (cancel.len < 1) {
            PyBuffer_Release(&cancel);
            PyErr_SetString(PyExc_ValueError, "cancel must hold at least one byte");
            return NULL;
        }
    }
    PyObject *requests = PySequence_Fast(requests_arg, "requests must be a sequence");
    if (requests == NULL) {
        if (cancel.obj != NULL) {
            PyBuffer_Release(&cancel);
        }
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(requests);
    Job *jobs = PyMem_Calloc(count > 0 ? count : 1, sizeof(Job));
    PyObject *results = NULL;
    if (jobs == NULL) {
        PyErr_NoMemory();
    } else if (take_buffers(requests, jobs, count) == 0) {
        Batch batch = {.jobs = jobs, .count = count};
        atomic_init(&batch.next, 0);
        batch.connect_timeout = seconds(connect_timeout);
        batch.timeout = seconds(timeout);
        batch.send_slice = seconds(timeout / SEND_SLICES);
        batch.timeout_s = timeout;
        batch.cancel = cancel.obj != NULL ? cancel.buf : NULL;
        batch.nice = sender_nice();
        char service[16];
        snprintf(service, sizeof service, "%d", port);
        struct addrinfo hints = {0};
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        int found;
        Py_BEGIN_ALLOW_THREADS
        found = getaddrinfo(host, service, &hints, &batch.addresses);
        if (found == 0) {
            int threads = connections < count ? connections : (int)count;
            pthread_t *ids = calloc(threads > 0 ? threads : 1, sizeof(pthread_t));
            int started = 0;
            for (; ids != NULL && started < threads; started++) {
                if (pthread_create(&ids[started], NULL, sender_thread, &batch) != 0) {
                    break;
                }
            }
            if (started == 0) {
                run_jobs(&batch); /* no thread could start: the caller sends, at its priority */
            }
            for (int i = 0; i < started; i++) {
                pthread_join(ids[i], NULL);
            }
            free(ids);
            freeaddrinfo(batch.addresses);
        }
        Py_END_ALLOW_THREADS
        if (found != 0) {
            PyErr_Format(PyExc_OSError, "cannot resolve %s: %s", host, gai_strerror(found));
        } else {
            results = results_of(jobs, count);
        }
    }
    if (jobs != NULL) {
        release_jobs(jobs, count);
    }
    Py_DECREF(requests);
    if (cancel.obj != NULL) {
        PyBuffer_Release(&cancel);
    }
    return results;
}

static PyMethodDef methods[] = {
    {"exchange", exchange, METH_VARARGS,
     "exchange(host, port, requests, connections, connect_timeout, timeout, cancel) -> list:\n"
     "each request, a (head, body) pair of buffers, sent on one of ``connections``\n"
     "connections without the GIL; for each, (0, answer bytes) or (errno, message).\n"
     "``timeout``: seconds a send or receive may go without progress. ``cancel``: a\n"
     "writable buffer whose first byte, once set, skips the requests not yet started (or\n"
     "None)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_sender",
    "A batch of in-memory HTTP/1.1 requests sent and answered without the GIL.", -1, methods,
};

PyMODINIT_FUNC PyInit__sender(void) { return PyModule_Create(&module); }
