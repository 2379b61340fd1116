/* A zero-cost S3 endpoint for benchmarks: objects in memory, no signatures checked.
 *
 * Built by benchmarks/zero_server.py with the machine's C compiler and started by the
 * benchmark itself on 127.0.0.1, so that what a benchmark measures is the client: the
 * server's own CPU per byte is one kernel copy in (recv into pooled, already mapped
 * memory) and none out (vmsplice). Path-style requests only.
 *
 *     ZERO_S3_POOL_MIB=N  maps and touches N MiB for received bodies before listening
 *
 * Speaks: PUT object (If-None-Match: * -> 412), GET (whole and ranged), HEAD, DELETE
 * (If-Match), CopyObject, multipart create / upload part / complete (If-None-Match) /
 * abort, ListMultipartUploads, ListObjectsV2 (prefix, delimiter, max-keys, continuation
 * token, start-after), ListObjects v1, DeleteObjects, HEAD/PUT bucket, GetBucketLocation,
 * ListBuckets. Bodies: Content-Length, Transfer-Encoding: chunked, Content-Encoding:
 * aws-chunked (signed or unsigned, with trailers), Expect: 100-continue. HTTP/1.1
 * keep-alive, one thread per connection. Completed multipart objects keep their parts as
 * segments: completing copies nothing.
 *
 *     zero_s3 [port]      prints "PORT <n>" on stdout once listening
 *
 * Built with -DZERO_S3_TLS (and -lssl -lcrypto), ZERO_S3_TLS_CERT and ZERO_S3_TLS_KEY (PEM
 * files) also serve the same objects over HTTPS on a second port, printed first as
 * "TLSPORT <n>": OpenSSL's SSL_read/SSL_write, the same one copy in, and one
 * encryption, out.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#ifdef ZERO_S3_TLS
#include <openssl/err.h>
#include <openssl/ssl.h>
#endif

#define HEAD_MAX (256 * 1024)
#define TABLE_SIZE 65536
#define MAX_PARTS 10000

/* ---- objects, uploads, the store ---------------------------------------------- */

/* a run of a body's bytes: a CHUNK from the pool (cap > 0), or malloc'd (cap == 0) */
typedef struct seg { char *p; size_t len, cap; } seg;

/* a body: its bytes in segments, in order */
typedef struct blob { seg *segs; int n; size_t len; } blob;

typedef struct obj {
    char *key;              /* "bucket/key" */
    size_t size;
    int nseg;
    seg *segs;
    char etag[48];          /* quoted */
    char ctype[128];
    char checksum[64];      /* x-amz-checksum-crc32c as sent, if any */
    time_t mtime;
    int refs;               /* the table's reference plus readers' */
    struct obj *next;
} obj;

typedef struct part { blob body; char etag[48]; int present; } part;

typedef struct upload {
    char id[40];
    char *key;
    time_t started;
    int nparts;             /* highest part number + 1 allocated */
    part *parts;
    struct upload *next;
} upload;

static obj *table[TABLE_SIZE];
static upload *uploads;
static char *buckets[1024];
static int nbuckets;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static unsigned long long counter;

static void release(seg *b);

static void release_blob(blob *b) {
    for (int i = 0; i < b->n; i++) release(&b->segs[i]);
    free(b->segs);
    b->segs = NULL;
    b->n = 0;
}

static unsigned hash(const char *s) {
    unsigned h = 2166136261u;
    while (*s) h = (h ^ (unsigned char)*s++) * 16777619u;
    return h % TABLE_SIZE;
}

static void obj_release(obj *o) { /* lock held */
    if (--o->refs > 0) return;
    for (int i = 0; i < o->nseg; i++) release(&o->segs[i]);
    free(o->segs);
    free(o->key);
    free(o);
}

/* ---- the chunk pool ------------------------------------------------------------------
 * Received bytes are copied once, by recv, into memory that is already mapped: bodies of
 * a MiB or more go into CHUNK-sized pieces from a pool (filled at start with
 * ZERO_S3_POOL_MIB of touched memory, and by every freed piece), so a save neither
 * faults nor zeroes fresh pages; GETs send them with vmsplice + splice, the pages going
 * to the socket by reference. A freed chunk waits REUSE_DELAY_S before it is reused, by
 * when any response still referencing its pages has long been read. */
#define BIG (1 << 20)
#define CHUNK ((size_t)4 << 20)
#define REUSE_DELAY_S 5
#define POOL_MAX ((size_t)16 << 30)

typedef struct pooled { char *p; time_t freed; struct pooled *next; } pooled;
static pooled *pool, *pool_tail;
static size_t pool_bytes;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

/* a chunk, oldest freed first (the pool is a FIFO); NULL when out of memory */
static char *chunk_get(void) {
    time_t now = time(NULL);
    pthread_mutex_lock(&pool_lock);
    pooled *head = pool;
    if (head && now - head->freed >= REUSE_DELAY_S) {
        pool = head->next;
        if (!pool) pool_tail = NULL;
        pool_bytes -= CHUNK;
        pthread_mutex_unlock(&pool_lock);
        char *p = head->p;
        free(head);
        return p;
    }
    pthread_mutex_unlock(&pool_lock);
    char *p = mmap(NULL, CHUNK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

static void chunk_put(char *p, time_t freed) {
    pthread_mutex_lock(&pool_lock);
    if (pool_bytes + CHUNK > POOL_MAX) {
        pthread_mutex_unlock(&pool_lock);
        munmap(p, CHUNK);
        return;
    }
    pooled *entry = malloc(sizeof *entry);
    *entry = (pooled){p, freed, NULL};
    if (pool_tail) pool_tail->next = entry;
    else pool = entry;
    pool_tail = entry;
    pool_bytes += CHUNK;
    pthread_mutex_unlock(&pool_lock);
}

static void release(seg *b) {
    if (!b->p) return;
    if (b->cap) chunk_put(b->p, time(NULL));
    else free(b->p);
    b->p = NULL;
}

static void fill_pool(size_t mib) {
    for (size_t i = 0; i < mib / (CHUNK >> 20); i++) {
        char *p = mmap(NULL, CHUNK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED) return;
        memset(p, 0, CHUNK);
        chunk_put(p, 0);
    }
}

static obj *lookup(const char *key) { /* lock held */
    for (obj *o = table[hash(key)]; o; o = o->next)
        if (!strcmp(o->key, key)) return o;
    return NULL;
}

static void unlink_obj(const char *key) { /* lock held */
    obj **p = &table[hash(key)];
    for (; *p; p = &(*p)->next)
        if (!strcmp((*p)->key, key)) {
            obj *o = *p;
            *p = o->next;
            obj_release(o);
            return;
        }
}

static void insert(obj *o) { /* lock held; replaces */
    unlink_obj(o->key);
    unsigned h = hash(o->key);
    o->refs = 1;
    o->next = table[h];
    table[h] = o;
}

static void note_bucket(const char *b) { /* lock held */
    for (int i = 0; i < nbuckets; i++)
        if (!strcmp(buckets[i], b)) return;
    if (nbuckets < 1024) buckets[nbuckets++] = strdup(b);
}

static void new_etag(char *out, size_t size, int parts) {
    unsigned long long n = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    unsigned long long mix = (n * 0x9E3779B97F4A7C15ull) ^ (size * 0xC2B2AE3D27D4EB4Full);
    if (parts) snprintf(out, 48, "\"%016llx%016llx-%d\"", mix, n, parts);
    else snprintf(out, 48, "\"%016llx%016llx\"", mix, n);
}

/* ---- a buffered connection ------------------------------------------------------ */

typedef struct conn {
    int fd;
#ifdef ZERO_S3_TLS
    SSL *ssl;               /* NULL on plain HTTP */
#endif
    char *buf;
    size_t start, end;      /* unread bytes buf[start:end] */
} conn;

/* one read from the connection (TLS or plain); waitall: until len or EOF */
static ssize_t conn_recv(conn *c, char *dst, size_t len, int waitall) {
#ifdef ZERO_S3_TLS
    if (c->ssl) {
        size_t got = 0;
        do {
            int n = SSL_read(c->ssl, dst + got, len - got > (1 << 30) ? (1 << 30) : (int)(len - got));
            if (n <= 0) return got ? (ssize_t)got : -1;
            got += (size_t)n;
        } while (waitall && got < len);
        return (ssize_t)got;
    }
#endif
    ssize_t n;
    do n = recv(c->fd, dst, len, waitall ? MSG_WAITALL : 0); while (n < 0 && errno == EINTR);
    return n;
}

static int send_all(int fd, const char *p, size_t len);

static int conn_send(conn *c, const char *p, size_t len) {
#ifdef ZERO_S3_TLS
    if (c->ssl) {
        while (len) {
            int n = SSL_write(c->ssl, p, len > (1 << 20) ? (1 << 20) : (int)len);
            if (n <= 0) return 0;
            p += n;
            len -= (size_t)n;
        }
        return 1;
    }
#endif
    return send_all(c->fd, p, len);
}

static int fill(conn *c) { /* more bytes into buf; 0 on EOF/error */
    if (c->start == c->end) c->start = c->end = 0;
    if (c->end == HEAD_MAX) {
        if (c->start == 0) return 0;
        memmove(c->buf, c->buf + c->start, c->end - c->start);
        c->end -= c->start;
        c->start = 0;
    }
    ssize_t n = c->fd < 0 ? 0 : conn_recv(c, c->buf + c->end, HEAD_MAX - c->end, 0);
    if (n <= 0) return 0;
    c->end += (size_t)n;
    return 1;
}

/* exactly len bytes into dst: what is buffered, then straight from the socket */
static int read_exact(conn *c, char *dst, size_t len) {
    size_t have = c->end - c->start;
    size_t take = have < len ? have : len;
    memcpy(dst, c->buf + c->start, take);
    c->start += take;
    dst += take;
    len -= take;
    while (len) {
        ssize_t n = c->fd < 0 ? 0 : conn_recv(c, dst, len, 1);
        if (n <= 0) return 0;
        dst += n;
        len -= (size_t)n;
    }
    return 1;
}

/* one CRLF-terminated line (without it) into line; 0 on error */
static int read_line(conn *c, char *line, size_t cap) {
    for (;;) {
        char *nl = memchr(c->buf + c->start, '\n', c->end - c->start);
        if (nl) {
            size_t n = (size_t)(nl - (c->buf + c->start));
            if (n && nl[-1] == '\r') n--;
            if (n >= cap) return 0;
            memcpy(line, c->buf + c->start, n);
            line[n] = 0;
            c->start = (size_t)(nl - c->buf) + 1;
            return 1;
        }
        if (!fill(c)) return 0;
    }
}

static int send_all(int fd, const char *p, size_t len) {
    while (len) {
        ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        p += n;
        len -= (size_t)n;
    }
    return 1;
}

/* ---- a growing byte string for responses --------------------------------------- */

typedef struct sbuf { char *p; size_t len, cap; } sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->len + n + 1 > b->cap) {
        b->cap = (b->len + n + 1) * 2 + 256;
        b->p = realloc(b->p, b->cap);
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}
static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }
static void sb_fmt(sbuf *b, const char *fmt, ...) {
    char tmp[4096];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) sb_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}
static void sb_xml(sbuf *b, const char *s) { /* XML-escaped text */
    for (; *s; s++) {
        switch (*s) {
        case '&': sb_str(b, "&amp;"); break;
        case '<': sb_str(b, "&lt;"); break;
        case '>': sb_str(b, "&gt;"); break;
        case '"': sb_str(b, "&quot;"); break;
        case '\'': sb_str(b, "&apos;"); break;
        default: sb_add(b, s, 1);
        }
    }
}

/* ---- requests -------------------------------------------------------------------- */

typedef struct request {
    char method[16];
    char bucket[256];
    char *key;              /* decoded, may be "" */
    char *query;            /* raw query string or "" */
    long long content_length;
    long long decoded_length;
    int chunked, aws_chunked, expect_continue, close, if_none_match_star;
    char if_match[128];
    char range[128];
    char ctype[128];
    char checksum[64];
    char copy_source[1024];
} request;

static void url_decode(char *s) {
    char *o = s;
    for (; *s; s++) {
        if (*s == '%' && isxdigit((unsigned char)s[1]) && isxdigit((unsigned char)s[2])) {
            char h[3] = {s[1], s[2], 0};
            *o++ = (char)strtol(h, NULL, 16);
            s += 2;
        } else if (*s == '+') {
            *o++ = ' ';
        } else {
            *o++ = *s;
        }
    }
    *o = 0;
}

static void path_decode(char *s) { /* like url_decode, but '+' stays '+' in paths */
    char *o = s;
    for (; *s; s++) {
        if (*s == '%' && isxdigit((unsigned char)s[1]) && isxdigit((unsigned char)s[2])) {
            char h[3] = {s[1], s[2], 0};
            *o++ = (char)strtol(h, NULL, 16);
            s += 2;
        } else {
            *o++ = *s;
        }
    }
    *o = 0;
}

/* the decoded value of query parameter name into out; 1 if present (even empty) */
static int qparam(const char *query, const char *name, char *out, size_t cap) {
    size_t nl = strlen(name);
    const char *p = query;
    while (p && *p) {
        const char *amp = strchr(p, '&');
        size_t len = amp ? (size_t)(amp - p) : strlen(p);
        if (len >= nl && !strncmp(p, name, nl) && (len == nl || p[nl] == '=')) {
            if (out) {
                size_t vl = len > nl ? len - nl - 1 : 0;
                if (vl >= cap) vl = cap - 1;
                memcpy(out, p + nl + (len > nl), vl);
                out[vl] = 0;
                url_decode(out);
            }
            return 1;
        }
        p = amp ? amp + 1 : NULL;
    }
    return 0;
}

static void http_date(char *out, size_t cap, time_t t) {
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, cap, "%a, %d %b %Y %H:%M:%S GMT", &tm);
}

static void iso_date(char *out, size_t cap, time_t t) {
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, cap, "%Y-%m-%dT%H:%M:%S.000Z", &tm);
}

static int respond(conn *c, request *r, int status, const char *reason, const char *headers,
                   const char *body, size_t body_len, int head_only) {
    char date[64], head[4096];
    http_date(date, sizeof date, time(NULL));
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nDate: %s\r\nServer: zero-s3\r\n"
                     "x-amz-request-id: %llx\r\nContent-Length: %zu\r\n%s%s\r\n",
                     status, reason, date, __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED),
                     body_len, headers ? headers : "", r->close ? "Connection: close\r\n" : "");
    if (head_only || !body_len) return conn_send(c, head, (size_t)n);
#ifdef ZERO_S3_TLS
    if (c->ssl) return conn_send(c, head, (size_t)n) && conn_send(c, body, body_len);
#endif
    struct iovec iov[2] = {{head, (size_t)n}, {(void *)body, body_len}};
    size_t total = (size_t)n + body_len;
    ssize_t sent = writev(c->fd, iov, 2);
    if (sent < 0) return 0;
    if ((size_t)sent == total) return 1;
    if ((size_t)sent < (size_t)n)
        return send_all(c->fd, head + sent, (size_t)n - (size_t)sent) && send_all(c->fd, body, body_len);
    return send_all(c->fd, body + (sent - n), total - (size_t)sent);
}

static int xml_response(conn *c, request *r, int status, const char *reason, sbuf *xml) {
    int ok = respond(c, r, status, reason, "Content-Type: application/xml\r\n", xml->p, xml->len, 0);
    free(xml->p);
    return ok;
}

static int error(conn *c, request *r, int status, const char *reason, const char *code,
                 const char *message) {
    sbuf x = {0};
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>");
    sb_str(&x, code);
    sb_str(&x, "</Code><Message>");
    sb_xml(&x, message);
    sb_str(&x, "</Message><Resource>/");
    sb_xml(&x, r->bucket);
    if (r->key && *r->key) { sb_str(&x, "/"); sb_xml(&x, r->key); }
    sb_str(&x, "</Resource><RequestId>0</RequestId></Error>");
    if (!strcmp(r->method, "HEAD")) { /* no body on HEAD */
        int ok = respond(c, r, status, reason, NULL, NULL, 0, 1);
        free(x.p);
        return ok;
    }
    return xml_response(c, r, status, reason, &x);
}

/* ---- request bodies ---------------------------------------------------------------- */

/* a chunked stream ("hex[;ext]\r\n" data "\r\n" ... "0\r\n" trailers "\r\n"), the shape
 * of both Transfer-Encoding: chunked and aws-chunked; appended to *out */
static int read_chunked(conn *c, char **out, size_t *len, size_t *cap) {
    char line[8192];
    for (;;) {
        if (!read_line(c, line, sizeof line)) return 0;
        char *end;
        unsigned long long n = strtoull(line, &end, 16);
        if (end == line) return 0;
        if (n == 0) break;
        if (*len + n > *cap) {
            *cap = (*len + n) * 2;
            *out = realloc(*out, *cap);
            if (!*out) return 0;
        }
        if (!read_exact(c, *out + *len, n)) return 0;
        *len += n;
        if (!read_line(c, line, sizeof line) || line[0]) return 0;
    }
    for (;;) { /* trailers (x-amz-checksum-*), until the empty line */
        if (!read_line(c, line, sizeof line)) return 0;
        if (!line[0]) return 1;
    }
}

/* the request's body, decoded, into a new buffer (*out, which the caller frees) */
static int read_body(conn *c, request *r, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    if (r->expect_continue && !conn_send(c, "HTTP/1.1 100 Continue\r\n\r\n", 25)) return 0;
    if (!r->chunked && !r->aws_chunked) {
        size_t n = r->content_length > 0 ? (size_t)r->content_length : 0;
        *out = malloc(n ? n : 1);
        if (!*out) return 0;
        *len = n;
        return read_exact(c, *out, n);
    }
    size_t cap = r->decoded_length > 0 ? (size_t)r->decoded_length : 1 << 20;
    if (r->chunked && r->aws_chunked) { /* both layers: undo HTTP chunking first */
        char *raw = NULL;
        size_t raw_len = 0, raw_cap = 1 << 20;
        raw = malloc(raw_cap);
        if (!raw || !read_chunked(c, &raw, &raw_len, &raw_cap)) { free(raw); return 0; }
        conn mem = {.fd = -1, .buf = raw, .start = 0, .end = raw_len};
        *out = malloc(cap);
        int ok = *out && read_chunked(&mem, out, len, &cap);
        free(raw);
        return ok;
    }
    if (r->aws_chunked && !r->chunked && r->content_length >= 0) {
        /* aws-chunked framed by Content-Length: the stream ends where the length does */
        *out = malloc(cap);
        return *out && read_chunked(c, out, len, &cap);
    }
    *out = malloc(cap);
    return *out && read_chunked(c, out, len, &cap);
}

/* ---- bodies into pooled buffers, and out of them ------------------------------------ */

/* the request's body, decoded, into *b (the caller releases it) */
static int read_body_blob(conn *c, request *r, blob *b) {
    *b = (blob){0};
    if (r->chunked || r->aws_chunked) { /* decoded into malloc'd memory */
        b->segs = calloc(1, sizeof(seg));
        b->n = 1;
        if (!read_body(c, r, &b->segs[0].p, &b->segs[0].len)) { release_blob(b); return 0; }
        b->len = b->segs[0].len;
        return 1;
    }
    if (r->expect_continue && !conn_send(c, "HTTP/1.1 100 Continue\r\n\r\n", 25)) return 0;
    size_t n = r->content_length > 0 ? (size_t)r->content_length : 0;
    b->len = n;
    if (n < BIG) {
        b->segs = calloc(1, sizeof(seg));
        b->n = 1;
        b->segs[0] = (seg){malloc(n ? n : 1), n, 0};
        if (b->segs[0].p && read_exact(c, b->segs[0].p, n)) return 1;
        release_blob(b);
        return 0;
    }
    b->segs = calloc((n + CHUNK - 1) / CHUNK, sizeof(seg));
    for (size_t at = 0; at < n; at += CHUNK) {
        size_t take = n - at < CHUNK ? n - at : CHUNK;
        seg *piece = &b->segs[b->n++];
        *piece = (seg){chunk_get(), take, CHUNK};
        if (!piece->p || !read_exact(c, piece->p, take)) { release_blob(b); return 0; }
    }
    return 1;
}

static __thread int pipe_fds[2] = {-1, -1};

/* len bytes at p to the socket: vmsplice maps the pages into a pipe, splice hands them
 * to TCP; nothing is copied on this side. Small or unaligned sends use send. */
static int send_pages(conn *c, const char *p, size_t len) {
    int fd = c->fd;
#ifdef ZERO_S3_TLS
    if (c->ssl) return conn_send(c, p, len);
#endif
    if (len < BIG) return send_all(fd, p, len);
    if (pipe_fds[0] < 0) {
        if (pipe2(pipe_fds, O_CLOEXEC)) return send_all(fd, p, len);
        fcntl(pipe_fds[1], F_SETPIPE_SZ, BIG);
    }
    while (len) {
        struct iovec iov = {(void *)p, len < BIG ? len : BIG};
        ssize_t n = vmsplice(pipe_fds[1], &iov, 1, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return 0;
        p += n;
        len -= (size_t)n;
        while (n) {
            ssize_t m = splice(pipe_fds[0], NULL, fd, NULL, (size_t)n, SPLICE_F_MOVE | (len ? SPLICE_F_MORE : 0));
            if (m < 0 && errno == EINTR) continue;
            if (m <= 0) return 0;
            n -= m;
        }
    }
    return 1;
}

/* ---- handlers ------------------------------------------------------------------------ */

static void full_key(request *r, char *out, size_t cap) { snprintf(out, cap, "%s/%s", r->bucket, r->key); }

static int handle_put_object(conn *c, request *r) {
    blob body;
    if (!read_body_blob(c, r, &body)) return 0;
    char key[4096];
    full_key(r, key, sizeof key);
    if (r->copy_source[0]) { /* CopyObject: bytes copied from the source */
        release_blob(&body);
        char src[1024];
        snprintf(src, sizeof src, "%s", r->copy_source[0] == '/' ? r->copy_source + 1 : r->copy_source);
        char *q = strchr(src, '?');
        if (q) *q = 0;
        path_decode(src);
        pthread_mutex_lock(&lock);
        obj *s = lookup(src);
        if (!s) { pthread_mutex_unlock(&lock); return error(c, r, 404, "Not Found", "NoSuchKey", "copy source not found"); }
        s->refs++;
        pthread_mutex_unlock(&lock);
        body = (blob){calloc((size_t)s->nseg, sizeof(seg)), s->nseg, s->size};
        for (int i = 0; i < s->nseg; i++) {
            seg *from = &s->segs[i];
            body.segs[i] = (seg){from->cap ? chunk_get() : malloc(from->len ? from->len : 1), from->len, from->cap};
            memcpy(body.segs[i].p, from->p, from->len);
        }
        pthread_mutex_lock(&lock);
        snprintf(r->ctype, sizeof r->ctype, "%s", s->ctype);
        obj_release(s);
        pthread_mutex_unlock(&lock);
    }
    obj *o = calloc(1, sizeof *o);
    o->key = strdup(key);
    o->size = body.len;
    o->nseg = body.n;
    o->segs = body.segs;
    o->mtime = time(NULL);
    snprintf(o->ctype, sizeof o->ctype, "%s", r->ctype[0] ? r->ctype : "binary/octet-stream");
    snprintf(o->checksum, sizeof o->checksum, "%s", r->checksum);
    new_etag(o->etag, body.len, 0);
    pthread_mutex_lock(&lock);
    if (r->if_none_match_star && lookup(key)) {
        pthread_mutex_unlock(&lock);
        o->refs = 1;
        obj_release(o);
        return error(c, r, 412, "Precondition Failed", "PreconditionFailed",
                     "At least one of the pre-conditions you specified did not hold");
    }
    note_bucket(r->bucket);
    insert(o);
    char etag[48], mtime[64];
    memcpy(etag, o->etag, sizeof etag);
    iso_date(mtime, sizeof mtime, o->mtime);
    pthread_mutex_unlock(&lock);
    char headers[512];
    if (r->copy_source[0]) {
        sbuf x = {0};
        sb_fmt(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CopyObjectResult><LastModified>%s</LastModified><ETag>", mtime);
        sb_xml(&x, etag);
        sb_str(&x, "</ETag></CopyObjectResult>");
        return xml_response(c, r, 200, "OK", &x);
    }
    int n = snprintf(headers, sizeof headers, "ETag: %s\r\n", etag);
    if (r->checksum[0]) snprintf(headers + n, sizeof headers - n, "x-amz-checksum-crc32c: %s\r\n", r->checksum);
    return respond(c, r, 200, "OK", headers, NULL, 0, 0);
}

static int parse_range(const char *spec, size_t size, size_t *first, size_t *last) {
    unsigned long long a, b;
    if (strncmp(spec, "bytes=", 6)) return 0;
    spec += 6;
    if (*spec == '-') { /* suffix */
        b = strtoull(spec + 1, NULL, 10);
        if (!b || !size) return -1;
        *first = b >= size ? 0 : size - b;
        *last = size - 1;
        return 1;
    }
    char *end;
    a = strtoull(spec, &end, 10);
    if (*end != '-') return 0;
    if (a >= size) return -1;
    b = end[1] ? strtoull(end + 1, NULL, 10) : size - 1;
    if (b >= size) b = size - 1;
    if (b < a) return -1;
    *first = a;
    *last = b;
    return 1;
}

static int handle_get_object(conn *c, request *r, int head_only) {
    char key[4096];
    full_key(r, key, sizeof key);
    pthread_mutex_lock(&lock);
    obj *o = lookup(key);
    if (!o) {
        pthread_mutex_unlock(&lock);
        return error(c, r, 404, "Not Found", "NoSuchKey", "The specified key does not exist.");
    }
    o->refs++;
    pthread_mutex_unlock(&lock);
    size_t first = 0, last = o->size ? o->size - 1 : 0, count = o->size;
    int status = 200, ranged = 0;
    if (r->range[0]) {
        int got = parse_range(r->range, o->size, &first, &last);
        if (got < 0) {
            pthread_mutex_lock(&lock);
            obj_release(o);
            pthread_mutex_unlock(&lock);
            return error(c, r, 416, "Requested Range Not Satisfiable", "InvalidRange",
                         "The requested range is not satisfiable");
        }
        if (got > 0) { ranged = 1; status = 206; count = last - first + 1; }
    }
    char date[64], lm[64], head[2048];
    http_date(date, sizeof date, time(NULL));
    http_date(lm, sizeof lm, o->mtime);
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 %d %s\r\nDate: %s\r\nServer: zero-s3\r\nContent-Length: %zu\r\n"
                     "ETag: %s\r\nLast-Modified: %s\r\nContent-Type: %s\r\nAccept-Ranges: bytes\r\n%s",
                     status, ranged ? "Partial Content" : "OK", date, count, o->etag, lm, o->ctype,
                     r->close ? "Connection: close\r\n" : "");
    if (ranged) n += snprintf(head + n, sizeof head - n, "Content-Range: bytes %zu-%zu/%zu\r\n", first, last, o->size);
    n += snprintf(head + n, sizeof head - n, "\r\n");
    int ok = conn_send(c, head, (size_t)n);
    if (ok && !head_only && count) {
        size_t at = 0, want_end = first + count;
        for (int i = 0; ok && i < o->nseg && at < want_end; i++) {
            size_t s0 = at, s1 = at + o->segs[i].len;
            at = s1;
            if (s1 <= first) continue;
            size_t from = first > s0 ? first - s0 : 0;
            size_t to = (want_end < s1 ? want_end : s1) - s0;
            ok = send_pages(c, o->segs[i].p + from, to - from);
        }
    }
    pthread_mutex_lock(&lock);
    obj_release(o);
    pthread_mutex_unlock(&lock);
    return ok;
}

static int handle_delete_object(conn *c, request *r) {
    char key[4096];
    full_key(r, key, sizeof key);
    pthread_mutex_lock(&lock);
    obj *o = lookup(key);
    if (r->if_match[0]) {
        if (!o) {
            pthread_mutex_unlock(&lock);
            return error(c, r, 404, "Not Found", "NoSuchKey", "The specified key does not exist.");
        }
        if (strcmp(r->if_match, "*") && strcmp(r->if_match, o->etag)) {
            pthread_mutex_unlock(&lock);
            return error(c, r, 412, "Precondition Failed", "PreconditionFailed",
                         "At least one of the pre-conditions you specified did not hold");
        }
    }
    if (o) unlink_obj(key);
    pthread_mutex_unlock(&lock);
    return respond(c, r, 204, "No Content", NULL, NULL, 0, 0);
}

static upload *find_upload(const char *id) { /* lock held */
    for (upload *u = uploads; u; u = u->next)
        if (!strcmp(u->id, id)) return u;
    return NULL;
}

static void free_upload(upload *u) { /* lock held, unlinked */
    for (int i = 0; i < u->nparts; i++)
        if (u->parts[i].present) release_blob(&u->parts[i].body);
    free(u->parts);
    free(u->key);
    free(u);
}

static void unlink_upload(upload *u) { /* lock held */
    for (upload **p = &uploads; *p; p = &(*p)->next)
        if (*p == u) { *p = u->next; return; }
}

static int handle_create_upload(conn *c, request *r) {
    char key[4096], *body;
    size_t len;
    if (!read_body(c, r, &body, &len)) { free(body); return 0; }
    free(body);
    full_key(r, key, sizeof key);
    upload *u = calloc(1, sizeof *u);
    unsigned long long n = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    snprintf(u->id, sizeof u->id, "%016llx%08x", n * 0x9E3779B97F4A7C15ull, (unsigned)n);
    u->key = strdup(key);
    u->started = time(NULL);
    pthread_mutex_lock(&lock);
    note_bucket(r->bucket);
    u->next = uploads;
    uploads = u;
    pthread_mutex_unlock(&lock);
    sbuf x = {0};
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<InitiateMultipartUploadResult><Bucket>");
    sb_xml(&x, r->bucket);
    sb_str(&x, "</Bucket><Key>");
    sb_xml(&x, r->key);
    sb_fmt(&x, "</Key><UploadId>%s</UploadId></InitiateMultipartUploadResult>", u->id);
    return xml_response(c, r, 200, "OK", &x);
}

static int handle_upload_part(conn *c, request *r, const char *id, int number) {
    blob body;
    if (!read_body_blob(c, r, &body)) return 0;
    if (number < 1 || number > MAX_PARTS) {
        release_blob(&body);
        return error(c, r, 400, "Bad Request", "InvalidArgument", "Part number must be an integer between 1 and 10000");
    }
    char etag[48];
    new_etag(etag, body.len, 0);
    /* looked up after the body is in: an abort or a complete meanwhile leaves no upload */
    pthread_mutex_lock(&lock);
    upload *u = find_upload(id);
    if (!u) {
        pthread_mutex_unlock(&lock);
        release_blob(&body);
        return error(c, r, 404, "Not Found", "NoSuchUpload", "The specified upload does not exist.");
    }
    if (number >= u->nparts) {
        int grow = number + 64 > MAX_PARTS + 1 ? MAX_PARTS + 1 : number + 64;
        u->parts = realloc(u->parts, sizeof(part) * (size_t)grow);
        memset(u->parts + u->nparts, 0, sizeof(part) * (size_t)(grow - u->nparts));
        u->nparts = grow;
    }
    part *p = &u->parts[number];
    if (p->present) release_blob(&p->body);
    p->body = body;
    p->present = 1;
    memcpy(p->etag, etag, sizeof etag);
    pthread_mutex_unlock(&lock);
    char headers[256];
    int n = snprintf(headers, sizeof headers, "ETag: %s\r\n", etag);
    if (r->checksum[0]) snprintf(headers + n, sizeof headers - n, "x-amz-checksum-crc32c: %s\r\n", r->checksum);
    return respond(c, r, 200, "OK", headers, NULL, 0, 0);
}

static int handle_complete(conn *c, request *r, const char *id) {
    char *body, key[4096];
    size_t len;
    if (!read_body(c, r, &body, &len)) { free(body); return 0; }
    body = realloc(body, len + 1);
    body[len] = 0;
    full_key(r, key, sizeof key);
    int numbers[MAX_PARTS], count = 0;
    for (char *p = body; (p = strstr(p, "<PartNumber>")) && count < MAX_PARTS; p += 12)
        numbers[count++] = atoi(p + 12);
    free(body);
    pthread_mutex_lock(&lock);
    upload *u = find_upload(id);
    if (!u || strcmp(u->key, key)) {
        pthread_mutex_unlock(&lock);
        /* an upload completed before: S3 answers NoSuchUpload */
        return error(c, r, 404, "Not Found", "NoSuchUpload", "The specified upload does not exist.");
    }
    if (!count) {
        pthread_mutex_unlock(&lock);
        return error(c, r, 400, "Bad Request", "MalformedXML", "no parts");
    }
    for (int i = 0; i < count; i++) {
        int n = numbers[i];
        if (n < 1 || n >= u->nparts || !u->parts[n].present || (i && n <= numbers[i - 1])) {
            pthread_mutex_unlock(&lock);
            return error(c, r, 400, "Bad Request", i && n <= numbers[i - 1] ? "InvalidPartOrder" : "InvalidPart",
                         "One or more of the specified parts could not be found.");
        }
    }
    if (r->if_none_match_star && lookup(key)) {
        pthread_mutex_unlock(&lock);
        return error(c, r, 412, "Precondition Failed", "PreconditionFailed",
                     "At least one of the pre-conditions you specified did not hold");
    }
    obj *o = calloc(1, sizeof *o);
    o->key = strdup(key);
    int total = 0;
    for (int i = 0; i < count; i++) total += u->parts[numbers[i]].body.n;
    o->segs = malloc(sizeof(seg) * (size_t)total);
    for (int i = 0; i < count; i++) {
        part *p = &u->parts[numbers[i]];
        memcpy(o->segs + o->nseg, p->body.segs, sizeof(seg) * (size_t)p->body.n);
        o->nseg += p->body.n;
        o->size += p->body.len;
        free(p->body.segs);
        p->body = (blob){0};
        p->present = 0;
    }
    o->mtime = time(NULL);
    snprintf(o->ctype, sizeof o->ctype, "binary/octet-stream");
    new_etag(o->etag, o->size, count);
    insert(o);
    unlink_upload(u);
    free_upload(u);
    char etag[48];
    memcpy(etag, o->etag, sizeof etag);
    pthread_mutex_unlock(&lock);
    sbuf x = {0};
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<CompleteMultipartUploadResult><Location>/");
    sb_xml(&x, r->bucket);
    sb_str(&x, "/");
    sb_xml(&x, r->key);
    sb_str(&x, "</Location><Bucket>");
    sb_xml(&x, r->bucket);
    sb_str(&x, "</Bucket><Key>");
    sb_xml(&x, r->key);
    sb_str(&x, "</Key><ETag>");
    sb_xml(&x, etag);
    sb_str(&x, "</ETag></CompleteMultipartUploadResult>");
    return xml_response(c, r, 200, "OK", &x);
}

static int handle_abort(conn *c, request *r, const char *id) {
    pthread_mutex_lock(&lock);
    upload *u = find_upload(id);
    if (!u) {
        pthread_mutex_unlock(&lock);
        return error(c, r, 404, "Not Found", "NoSuchUpload", "The specified upload does not exist.");
    }
    unlink_upload(u);
    free_upload(u); /* a part still arriving finds no upload and is dropped */
    pthread_mutex_unlock(&lock);
    return respond(c, r, 204, "No Content", NULL, NULL, 0, 0);
}

static int handle_list_uploads(conn *c, request *r) {
    char prefix[2048] = "";
    qparam(r->query, "prefix", prefix, sizeof prefix);
    size_t bl = strlen(r->bucket);
    sbuf x = {0};
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListMultipartUploadsResult><Bucket>");
    sb_xml(&x, r->bucket);
    sb_str(&x, "</Bucket><Prefix>");
    sb_xml(&x, prefix);
    sb_str(&x, "</Prefix><MaxUploads>1000</MaxUploads><IsTruncated>false</IsTruncated>");
    pthread_mutex_lock(&lock);
    for (upload *u = uploads; u; u = u->next) {
        if (strncmp(u->key, r->bucket, bl) || u->key[bl] != '/') continue;
        const char *k = u->key + bl + 1;
        if (strncmp(k, prefix, strlen(prefix))) continue;
        char when[64];
        iso_date(when, sizeof when, u->started);
        sb_str(&x, "<Upload><Key>");
        sb_xml(&x, k);
        sb_fmt(&x, "</Key><UploadId>%s</UploadId><Initiated>%s</Initiated><StorageClass>STANDARD</StorageClass></Upload>", u->id, when);
    }
    pthread_mutex_unlock(&lock);
    sb_str(&x, "</ListMultipartUploadsResult>");
    return xml_response(c, r, 200, "OK", &x);
}

typedef struct entry { char *key; size_t size; char etag[48]; time_t mtime; } entry;
static int cmp_entry(const void *a, const void *b) { return strcmp(((const entry *)a)->key, ((const entry *)b)->key); }

static int handle_list(conn *c, request *r, int v2) {
    char prefix[2048] = "", delim[64] = "", token[4096] = "", after[4096] = "", max_s[32] = "";
    qparam(r->query, "prefix", prefix, sizeof prefix);
    qparam(r->query, "delimiter", delim, sizeof delim);
    qparam(r->query, "max-keys", max_s, sizeof max_s);
    if (v2) {
        qparam(r->query, "continuation-token", token, sizeof token);
        qparam(r->query, "start-after", after, sizeof after);
    } else {
        qparam(r->query, "marker", after, sizeof after);
    }
    int max = max_s[0] ? atoi(max_s) : 1000;
    if (max < 0 || max > 1000) max = 1000;
    const char *from = token[0] ? token : after;
    size_t bl = strlen(r->bucket), pl = strlen(prefix), dl = strlen(delim);
    entry *all = NULL;
    size_t n = 0, cap = 0;
    pthread_mutex_lock(&lock);
    for (int h = 0; h < TABLE_SIZE; h++)
        for (obj *o = table[h]; o; o = o->next) {
            if (strncmp(o->key, r->bucket, bl) || o->key[bl] != '/') continue;
            const char *k = o->key + bl + 1;
            if (strncmp(k, prefix, pl) || (from[0] && strcmp(k, from) <= 0)) continue;
            if (n == cap) { cap = cap ? cap * 2 : 256; all = realloc(all, cap * sizeof *all); }
            all[n].key = strdup(k);
            all[n].size = o->size;
            all[n].mtime = o->mtime;
            memcpy(all[n].etag, o->etag, 48);
            n++;
        }
    pthread_mutex_unlock(&lock);
    qsort(all, n, sizeof *all, cmp_entry);
    sbuf body = {0}, x = {0};
    char **prefixes = NULL;
    size_t np = 0, ncap = 0;
    int count = 0, truncated = 0;
    const char *last = NULL;
    for (size_t i = 0; i < n; i++) {
        const char *k = all[i].key;
        const char *d = dl ? strstr(k + pl, delim) : NULL;
        if (d) { /* rolled up under a common prefix */
            size_t cl = (size_t)(d - k) + dl;
            if (np && !strncmp(prefixes[np - 1], k, cl) && prefixes[np - 1][cl] == 0) continue;
            if (count == max) { truncated = 1; break; }
            if (np == ncap) { ncap = ncap ? ncap * 2 : 64; prefixes = realloc(prefixes, ncap * sizeof *prefixes); }
            prefixes[np++] = strndup(k, cl);
            count++;
            last = k;
            continue;
        }
        if (count == max) { truncated = 1; break; }
        char when[64];
        iso_date(when, sizeof when, all[i].mtime);
        sb_str(&body, "<Contents><Key>");
        sb_xml(&body, k);
        sb_fmt(&body, "</Key><LastModified>%s</LastModified><ETag>", when);
        sb_xml(&body, all[i].etag);
        sb_fmt(&body, "</ETag><Size>%zu</Size><StorageClass>STANDARD</StorageClass></Contents>", all[i].size);
        count++;
        last = k;
    }
    /* the continuation token is the last key returned; a rolled-up prefix continues past
     * everything under it */
    char next[4096] = "";
    if (truncated && last) {
        if (np && !strncmp(last, prefixes[np - 1], strlen(prefixes[np - 1])))
            snprintf(next, sizeof next, "%s\xf4\x8f\xbf\xbf", prefixes[np - 1]);
        else
            snprintf(next, sizeof next, "%s", last);
    }
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListBucketResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"><Name>");
    sb_xml(&x, r->bucket);
    sb_str(&x, "</Name><Prefix>");
    sb_xml(&x, prefix);
    sb_str(&x, "</Prefix>");
    if (dl) { sb_str(&x, "<Delimiter>"); sb_xml(&x, delim); sb_str(&x, "</Delimiter>"); }
    sb_fmt(&x, "<MaxKeys>%d</MaxKeys><IsTruncated>%s</IsTruncated>", max, truncated ? "true" : "false");
    if (v2) {
        sb_fmt(&x, "<KeyCount>%d</KeyCount>", count);
        if (token[0]) { sb_str(&x, "<ContinuationToken>"); sb_xml(&x, token); sb_str(&x, "</ContinuationToken>"); }
        if (after[0]) { sb_str(&x, "<StartAfter>"); sb_xml(&x, after); sb_str(&x, "</StartAfter>"); }
        if (truncated) { sb_str(&x, "<NextContinuationToken>"); sb_xml(&x, next); sb_str(&x, "</NextContinuationToken>"); }
    } else {
        sb_str(&x, "<Marker>");
        sb_xml(&x, after);
        sb_str(&x, "</Marker>");
        if (truncated) { sb_str(&x, "<NextMarker>"); sb_xml(&x, next); sb_str(&x, "</NextMarker>"); }
    }
    if (body.len) sb_add(&x, body.p, body.len);
    for (size_t i = 0; i < np; i++) {
        sb_str(&x, "<CommonPrefixes><Prefix>");
        sb_xml(&x, prefixes[i]);
        sb_str(&x, "</Prefix></CommonPrefixes>");
        free(prefixes[i]);
    }
    sb_str(&x, "</ListBucketResult>");
    for (size_t i = 0; i < n; i++) free(all[i].key);
    free(all);
    free(prefixes);
    free(body.p);
    return xml_response(c, r, 200, "OK", &x);
}

static void xml_unescape(char *s) {
    static const struct { const char *e; char c; } map[] = {
        {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}};
    char *o = s;
    while (*s) {
        int done = 0;
        if (*s == '&') {
            for (size_t i = 0; i < sizeof map / sizeof *map; i++) {
                size_t l = strlen(map[i].e);
                if (!strncmp(s, map[i].e, l)) { *o++ = map[i].c; s += l; done = 1; break; }
            }
            if (!done && s[1] == '#') {
                char *end;
                long v = s[2] == 'x' ? strtol(s + 3, &end, 16) : strtol(s + 2, &end, 10);
                if (*end == ';' && v > 0 && v < 128) { *o++ = (char)v; s = end + 1; done = 1; }
            }
        }
        if (!done) *o++ = *s++;
    }
    *o = 0;
}

static int handle_delete_objects(conn *c, request *r) {
    char *body;
    size_t len;
    if (!read_body(c, r, &body, &len)) { free(body); return 0; }
    body = realloc(body, len + 1);
    body[len] = 0;
    int quiet = strstr(body, "<Quiet>true</Quiet>") != NULL;
    sbuf x = {0};
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">");
    for (char *p = body; (p = strstr(p, "<Key>")); ) {
        p += 5;
        char *end = strstr(p, "</Key>");
        if (!end) break;
        char *k = strndup(p, (size_t)(end - p));
        xml_unescape(k);
        char key[4096];
        snprintf(key, sizeof key, "%s/%s", r->bucket, k);
        pthread_mutex_lock(&lock);
        unlink_obj(key);
        pthread_mutex_unlock(&lock);
        if (!quiet) { sb_str(&x, "<Deleted><Key>"); sb_xml(&x, k); sb_str(&x, "</Key></Deleted>"); }
        free(k);
        p = end + 6;
    }
    free(body);
    sb_str(&x, "</DeleteResult>");
    return xml_response(c, r, 200, "OK", &x);
}

static int handle_list_buckets(conn *c, request *r) {
    sbuf x = {0};
    char when[64];
    iso_date(when, sizeof when, time(NULL));
    sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<ListAllMyBucketsResult><Owner><ID>zero</ID><DisplayName>zero</DisplayName></Owner><Buckets>");
    pthread_mutex_lock(&lock);
    for (int i = 0; i < nbuckets; i++) {
        sb_str(&x, "<Bucket><Name>");
        sb_xml(&x, buckets[i]);
        sb_fmt(&x, "</Name><CreationDate>%s</CreationDate></Bucket>", when);
    }
    pthread_mutex_unlock(&lock);
    sb_str(&x, "</Buckets></ListAllMyBucketsResult>");
    return xml_response(c, r, 200, "OK", &x);
}

/* a body the handler does not need still has to be read off the connection */
static int drain(conn *c, request *r) {
    char *body;
    size_t len;
    int ok = read_body(c, r, &body, &len);
    free(body);
    return ok;
}

static int dispatch(conn *c, request *r) {
    const char *m = r->method;
    int has_key = r->key && *r->key;
    char id[128] = "", num[32] = "";
    int upload_id = qparam(r->query, "uploadId", id, sizeof id);
    if (!r->bucket[0]) {
        if (!drain(c, r)) return 0;
        return handle_list_buckets(c, r);
    }
    if (has_key) {
        if (!strcmp(m, "PUT")) {
            if (upload_id && qparam(r->query, "partNumber", num, sizeof num))
                return handle_upload_part(c, r, id, atoi(num));
            return handle_put_object(c, r);
        }
        if (!strcmp(m, "POST")) {
            if (qparam(r->query, "uploads", NULL, 0)) return handle_create_upload(c, r);
            if (upload_id) return handle_complete(c, r, id);
        }
        if (!drain(c, r)) return 0;
        if (!strcmp(m, "GET") || !strcmp(m, "HEAD")) {
            if (upload_id) return error(c, r, 501, "Not Implemented", "NotImplemented", "ListParts is not implemented");
            return handle_get_object(c, r, !strcmp(m, "HEAD"));
        }
        if (!strcmp(m, "DELETE")) {
            if (upload_id) return handle_abort(c, r, id);
            return handle_delete_object(c, r);
        }
        return error(c, r, 405, "Method Not Allowed", "MethodNotAllowed", "method not allowed");
    }
    if (!strcmp(m, "POST") && qparam(r->query, "delete", NULL, 0)) return handle_delete_objects(c, r);
    if (!drain(c, r)) return 0;
    if (!strcmp(m, "GET")) {
        if (qparam(r->query, "uploads", NULL, 0)) return handle_list_uploads(c, r);
        if (qparam(r->query, "location", NULL, 0)) {
            sbuf x = {0};
            sb_str(&x, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<LocationConstraint xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\"></LocationConstraint>");
            return xml_response(c, r, 200, "OK", &x);
        }
        char lt[8] = "";
        qparam(r->query, "list-type", lt, sizeof lt);
        return handle_list(c, r, !strcmp(lt, "2"));
    }
    if (!strcmp(m, "HEAD")) return respond(c, r, 200, "OK", "x-amz-bucket-region: us-east-1\r\n", NULL, 0, 1);
    if (!strcmp(m, "PUT")) {
        pthread_mutex_lock(&lock);
        note_bucket(r->bucket);
        pthread_mutex_unlock(&lock);
        return respond(c, r, 200, "OK", NULL, NULL, 0, 0);
    }
    if (!strcmp(m, "DELETE")) return respond(c, r, 204, "No Content", NULL, NULL, 0, 0);
    return error(c, r, 405, "Method Not Allowed", "MethodNotAllowed", "method not allowed");
}

static int parse_head(conn *c, request *r, char *target) {
    char line[HEAD_MAX];
    if (!read_line(c, line, sizeof line)) return 0;
    char version[16];
    if (sscanf(line, "%15s %65535s %15s", r->method, target, version) != 3) return 0;
    r->content_length = -1;
    r->decoded_length = -1;
    if (!strcmp(version, "HTTP/1.0")) r->close = 1;
    for (;;) {
        if (!read_line(c, line, sizeof line)) return 0;
        if (!line[0]) break;
        char *colon = strchr(line, ':');
        if (!colon) continue;
        *colon = 0;
        char *v = colon + 1;
        while (*v == ' ' || *v == '\t') v++;
        const char *h = line;
        if (!strcasecmp(h, "content-length")) r->content_length = atoll(v);
        else if (!strcasecmp(h, "x-amz-decoded-content-length")) r->decoded_length = atoll(v);
        else if (!strcasecmp(h, "transfer-encoding")) r->chunked = strcasestr(v, "chunked") != NULL;
        else if (!strcasecmp(h, "content-encoding")) r->aws_chunked = strcasestr(v, "aws-chunked") != NULL;
        else if (!strcasecmp(h, "expect")) r->expect_continue = strcasestr(v, "100-continue") != NULL;
        else if (!strcasecmp(h, "connection")) r->close = strcasestr(v, "close") != NULL;
        else if (!strcasecmp(h, "if-none-match")) r->if_none_match_star = !strcmp(v, "*");
        else if (!strcasecmp(h, "if-match")) snprintf(r->if_match, sizeof r->if_match, "%s", v);
        else if (!strcasecmp(h, "range")) snprintf(r->range, sizeof r->range, "%s", v);
        else if (!strcasecmp(h, "content-type")) snprintf(r->ctype, sizeof r->ctype, "%s", v);
        else if (!strcasecmp(h, "x-amz-checksum-crc32c")) snprintf(r->checksum, sizeof r->checksum, "%s", v);
        else if (!strcasecmp(h, "x-amz-copy-source")) snprintf(r->copy_source, sizeof r->copy_source, "%s", v);
    }
    /* a quoted If-Match compares with our quoted ETags */
    if (r->if_match[0] && r->if_match[0] != '"' && strcmp(r->if_match, "*")) {
        char q[128];
        snprintf(q, sizeof q, "\"%.125s\"", r->if_match);
        memcpy(r->if_match, q, sizeof q);
    }
    char *path = target;
    if (!strncmp(path, "http://", 7)) { path = strchr(path + 7, '/'); if (!path) path = "/"; }
    char *q = strchr(path, '?');
    r->query = q ? q + 1 : "";
    if (q) *q = 0;
    while (*path == '/') path++;
    char *slash = strchr(path, '/');
    r->key = slash ? slash + 1 : path + strlen(path);
    if (slash) *slash = 0;
    snprintf(r->bucket, sizeof r->bucket, "%s", path);
    path_decode(r->bucket);
    path_decode(r->key);
    return 1;
}

#ifdef ZERO_S3_TLS
static SSL_CTX *tls_ctx;
#endif

static void serve_conn(conn c);

static void *serve(void *arg) {
    conn c = {.fd = (int)(intptr_t)arg};
    serve_conn(c);
    return NULL;
}

#ifdef ZERO_S3_TLS
/* a connection on the TLS port: the handshake, then HTTP as on the plain one */
static void *serve_tls(void *arg) {
    conn c = {.fd = (int)(intptr_t)arg, .ssl = SSL_new(tls_ctx)};
    SSL_set_fd(c.ssl, c.fd);
    if (SSL_accept(c.ssl) == 1) {
        serve_conn(c);
    } else {
        close(c.fd);
    }
    SSL_free(c.ssl);
    return NULL;
}
#endif

static void serve_conn(conn c) {
    c.buf = malloc(HEAD_MAX);
    char *target = malloc(HEAD_MAX);
    int one = 1;
    setsockopt(c.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (;;) {
        request r;
        memset(&r, 0, sizeof r);
        if (!parse_head(&c, &r, target)) break;
        if (!dispatch(&c, &r) || r.close) break;
    }
#ifdef ZERO_S3_TLS
    if (c.ssl) SSL_shutdown(c.ssl);
#endif
    close(c.fd);
    free(c.buf);
    free(target);
}

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) || listen(fd, 1024)) { perror("zero_s3"); exit(1); }
    return fd;
}

static int port_of(int fd) {
    struct sockaddr_in addr;
    socklen_t al = sizeof addr;
    getsockname(fd, (struct sockaddr *)&addr, &al);
    return ntohs(addr.sin_port);
}

static pthread_attr_t attr;

static void *accept_loop(void *arg) {
    int fd = (int)(intptr_t)arg & 0xffffff, tls = (int)((intptr_t)arg >> 24);
    for (;;) {
        int client = accept(fd, NULL, NULL);
        if (client < 0) { if (errno == EINTR || errno == ECONNABORTED) continue; perror("accept"); exit(1); }
        pthread_t t;
#ifdef ZERO_S3_TLS
        void *(*handler)(void *) = tls ? serve_tls : serve;
#else
        void *(*handler)(void *) = serve;
        (void)tls;
#endif
        if (pthread_create(&t, &attr, handler, (void *)(intptr_t)client)) close(client);
    }
    return NULL;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    const char *pool_mib = getenv("ZERO_S3_POOL_MIB");
    if (pool_mib) fill_pool((size_t)atoll(pool_mib));
    struct rlimit files;
    if (!getrlimit(RLIMIT_NOFILE, &files)) { files.rlim_cur = files.rlim_max; setrlimit(RLIMIT_NOFILE, &files); }
    int port = argc > 1 ? atoi(argv[1]) : 0;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 1 << 20);
    int fd = listen_on(port);
#ifdef ZERO_S3_TLS
    const char *cert = getenv("ZERO_S3_TLS_CERT"), *key = getenv("ZERO_S3_TLS_KEY");
    if (cert && key) {
        tls_ctx = SSL_CTX_new(TLS_server_method());
        if (!tls_ctx || SSL_CTX_use_certificate_chain_file(tls_ctx, cert) != 1 ||
            SSL_CTX_use_PrivateKey_file(tls_ctx, key, SSL_FILETYPE_PEM) != 1) {
            ERR_print_errors_fp(stderr);
            return 1;
        }
        int tls_fd = listen_on(0);
        printf("TLSPORT %d\n", port_of(tls_fd));
        pthread_t t;
        pthread_create(&t, &attr, accept_loop, (void *)(((intptr_t)1 << 24) | tls_fd));
    }
#endif
    printf("PORT %d\n", port_of(fd));
    fflush(stdout);
    accept_loop((void *)(intptr_t)fd);
    return 0;
}
