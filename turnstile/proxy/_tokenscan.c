/*
 * turnstile.proxy._tokenscan: the recorded fields of a vLLM answer, straight from its bytes.
 *
 * One pass over a whole chat/completions response (or one stream chunk) validates it as
 * JSON and fills C buffers with what Turnstile records: the prompt and completion token
 * ids (int32), one behaviour logprob per token (float32) and, when asked, the top-k ids
 * and values. No Python object is made per token. The small fields that are not token
 * arrays (model, usage, message or delta, text, finish and stop reasons) come back as
 * byte offsets for the caller to decode.
 *
 * The scanner is deliberately stricter than the decoders it stands in for
 * (turnstile/proxy/sparse.py, then orjson): whenever an answer is not exactly the expected
 * shape (an unexpected type, a duplicated key, an escape in a key or a top-k token, a
 * number that is not a plain int32 id or a finite double, a surrogate escape, invalid
 * UTF-8, nesting deeper than MAX_DEPTH) it returns None and the caller decodes the body
 * the slow way, which accepts, records or refuses it as before. Every answer it does
 * accept gives bit-identical values to that path (a property test checks it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_TOKEN_ID 2147483647LL /* turnstile.limits.MAX_TOKEN_ID */
#define MAX_CHOICE_INDEX 16383    /* turnstile.limits.MAX_CHOICE_INDEX */
#define MAX_DEPTH 255             /* turnstile.limits.MAX_JSON_DEPTH */
#define MAX_NUMBER_CHARS 64       /* longer numbers go to the slow path */
#define ID_PREFIX "token_id:"
#define ID_PREFIX_LEN 9
#define MAX_ID_DIGITS 10

/* -- growable buffers ------------------------------------------------------------------ */
typedef struct {
    char *data;
    Py_ssize_t len;
    Py_ssize_t cap;
} Buf;

static int buf_push(Buf *b, const void *value, Py_ssize_t size) {
    if (b->len + size > b->cap) {
        Py_ssize_t cap = b->cap ? b->cap * 2 : 4096;
        while (cap < b->len + size) cap *= 2;
        char *data = PyMem_Realloc(b->data, (size_t)cap);
        if (data == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        b->data = data;
        b->cap = cap;
    }
    memcpy(b->data + b->len, value, (size_t)size);
    b->len += size;
    return 0;
}

static void buf_free(Buf *b) {
    PyMem_Free(b->data);
    b->data = NULL;
    b->len = b->cap = 0;
}

/* A bytearray holding the buffer's bytes (None when `present` is false). */
static PyObject *buf_take(Buf *b, int present) {
    if (!present) Py_RETURN_NONE;
    return PyByteArray_FromStringAndSize(b->data ? b->data : "", b->len);
}

/* -- the scanner ------------------------------------------------------------------------ */
/* Results of the scanning functions. */
#define OK 0
#define MISFIT -1 /* not the expected shape: the caller decodes the slow way */
#define ERROR -2  /* a Python exception is set (memory) */

typedef struct {
    const unsigned char *start;
    const unsigned char *p;
    const unsigned char *end;
    PyObject *recorded; /* list of (start, end, kind) of the recorded values, or NULL */
} Scanner;

/* The kinds of recorded values (what a client that did not ask for them must not see). */
#define RECORDED_IDS 0
#define RECORDED_LOGPROBS 1

typedef struct {
    Py_ssize_t start; /* -1: absent */
    Py_ssize_t end;
} Span;

static const double POW10[] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                               1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                               1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

static inline void ws(Scanner *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t'))
        s->p++;
}

static inline int peek(Scanner *s) { return s->p < s->end ? *s->p : -1; }

static inline int eat(Scanner *s, unsigned char c) {
    ws(s);
    if (s->p < s->end && *s->p == c) {
        s->p++;
        return 1;
    }
    return 0;
}

static int literal(Scanner *s, const char *word, Py_ssize_t n) {
    if (s->end - s->p < n || memcmp(s->p, word, (size_t)n) != 0) return MISFIT;
    s->p += n;
    return OK;
}

static int hex4(const unsigned char *p, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned c = p[i], d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return -1;
        v = v * 16 + d;
    }
    *out = v;
    return 0;
}

/* One UTF-8 sequence of 2-4 bytes at s->p (its first byte >= 0x80), validated. */
static int utf8_seq(Scanner *s) {
    const unsigned char *p = s->p;
    Py_ssize_t left = s->end - p;
    unsigned c = p[0];
    int n;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) n = 1;
    else if (c >= 0xE0 && c <= 0xEF) {
        n = 2;
        if (c == 0xE0) lo = 0xA0;
        if (c == 0xED) hi = 0x9F; /* no surrogates */
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 3;
        if (c == 0xF0) lo = 0x90;
        if (c == 0xF4) hi = 0x8F;
    } else return MISFIT;
    if (left <= n) return MISFIT;
    if (p[1] < lo || p[1] > hi) return MISFIT;
    for (int i = 2; i <= n; i++)
        if ((p[i] & 0xC0) != 0x80) return MISFIT;
    s->p += n + 1;
    return OK;
}

/* A string at s->p (its opening quote); `escaped` tells whether it held any escape. The
 * content is [*from, *to). Surrogate escapes are refused (stricter than JSON). */
static int string(Scanner *s, const unsigned char **from, const unsigned char **to, int *escaped) {
    if (peek(s) != '"') return MISFIT;
    s->p++;
    *from = s->p;
    *escaped = 0;
    for (;;) {
        while (s->p < s->end && *s->p >= 0x20 && *s->p < 0x80 && *s->p != '"' && *s->p != '\\')
            s->p++;
        if (s->p >= s->end) return MISFIT;
        unsigned c = *s->p;
        if (c == '"') {
            *to = s->p;
            s->p++;
            return OK;
        }
        if (c < 0x20) return MISFIT;
        if (c >= 0x80) {
            if (utf8_seq(s) != OK) return MISFIT;
            continue;
        }
        /* a backslash */
        *escaped = 1;
        if (s->end - s->p < 2) return MISFIT;
        c = s->p[1];
        if (c == 'u') {
            unsigned cp;
            if (s->end - s->p < 6 || hex4(s->p + 2, &cp) != 0) return MISFIT;
            if (cp >= 0xDC00 && cp <= 0xDFFF) return MISFIT; /* a lone low surrogate */
            if (cp >= 0xD800 && cp <= 0xDBFF) {
                /* a high surrogate: valid only as the first half of a pair */
                unsigned low;
                if (s->end - s->p < 12 || s->p[6] != '\\' || s->p[7] != 'u' ||
                    hex4(s->p + 8, &low) != 0 || low < 0xDC00 || low > 0xDFFF)
                    return MISFIT;
                s->p += 6;
            }
            s->p += 6;
        } else if (c == '"' || c == '\\' || c == '/' || c == 'b' || c == 'f' || c == 'n' ||
                   c == 'r' || c == 't') {
            s->p += 2;
        } else return MISFIT;
    }
}

static int skip_string(Scanner *s) {
    const unsigned char *a, *b;
    int esc;
    return string(s, &a, &b, &esc);
}

/* A number's grammar (RFC 8259) at s->p; `integer` tells whether it had no fraction or
 * exponent. */
static int number(Scanner *s, const unsigned char **from, int *integer) {
    const unsigned char *p = s->p, *e = s->end;
    *from = p;
    *integer = 1;
    if (p < e && *p == '-') p++;
    if (p >= e) return MISFIT;
    if (*p == '0') p++;
    else if (*p >= '1' && *p <= '9')
        while (p < e && *p >= '0' && *p <= '9') p++;
    else return MISFIT;
    if (p < e && *p == '.') {
        *integer = 0;
        p++;
        if (p >= e || *p < '0' || *p > '9') return MISFIT;
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    if (p < e && (*p == 'e' || *p == 'E')) {
        *integer = 0;
        p++;
        if (p < e && (*p == '+' || *p == '-')) p++;
        if (p >= e || *p < '0' || *p > '9') return MISFIT;
        while (p < e && *p >= '0' && *p <= '9') p++;
    }
    s->p = p;
    return OK;
}

/* The double a JSON number [from, to) stands for, as Python's float() of the decoded value
 * gives it; MISFIT where it is not finite or too long to be worth converting here. */
static int to_double(const unsigned char *from, const unsigned char *to, int integer, double *out) {
    const unsigned char *p = from;
    int negative = 0;
    if (*p == '-') {
        negative = 1;
        p++;
    }
    uint64_t mantissa = 0;
    int digits = 0, frac_digits = 0, seen_point = 0;
    long exp10 = 0;
    for (; p < to; p++) {
        unsigned c = *p;
        if (c >= '0' && c <= '9') {
            if (mantissa == 0 && c == '0') {
                if (seen_point) frac_digits++;
                continue; /* leading zeros are not significant */
            }
            if (++digits > 19) break;
            mantissa = mantissa * 10 + (c - '0');
            if (seen_point) frac_digits++;
        } else if (c == '.') seen_point = 1;
        else break; /* the exponent */
    }
    if (digits <= 19 && p < to && (*p == 'e' || *p == 'E')) {
        p++;
        int exp_negative = 0;
        if (*p == '+' || *p == '-') exp_negative = *p++ == '-';
        long e = 0;
        for (; p < to; p++) {
            e = e * 10 + (*p - '0');
            if (e > 100000) break;
        }
        exp10 = exp_negative ? -e : e;
    }
    if (digits <= 19 && p >= to) {
        if (mantissa == 0) {
            /* the int -0 decodes to the int 0, whose float is +0.0; -0.0 keeps its sign */
            *out = (negative && !integer) ? -0.0 : 0.0;
            return OK;
        }
        long scale = exp10 - frac_digits;
        if (mantissa <= (1ULL << 53) && scale >= -22 && scale <= 22) {
            double d = (double)mantissa; /* exact */
            d = scale < 0 ? d / POW10[-scale] : d * POW10[scale]; /* one rounding: exact */
            *out = negative ? -d : d;
            return OK;
        }
    }
    /* Python's own correctly rounded conversion, for everything else. */
    Py_ssize_t n = to - from;
    if (n >= MAX_NUMBER_CHARS) return MISFIT;
    char text[MAX_NUMBER_CHARS];
    memcpy(text, from, (size_t)n);
    text[n] = '\0';
    char *stop = NULL;
    double d = PyOS_string_to_double(text, &stop, NULL);
    if (d == -1.0 && PyErr_Occurred()) {
        PyErr_Clear();
        return MISFIT;
    }
    if (stop != text + n || d != d || d - d != 0.0) return MISFIT; /* not finite */
    *out = d;
    return OK;
}

/* A number the decoders take: msgspec refuses one beyond a double (1e400) wherever it is. */
static int finite_number(Scanner *s) {
    const unsigned char *from;
    int integer;
    if (number(s, &from, &integer) != OK) return MISFIT;
    if (integer) return s->p - from <= 300 ? OK : MISFIT; /* far below 1e308 */
    double d;
    return to_double(from, s->p, integer, &d);
}

static int skip_value(Scanner *s, int depth);

/* Notes the recorded value [from, s->p) unless it is null. */
static int note(Scanner *s, const unsigned char *from, int kind) {
    if (s->recorded == NULL || (s->p - from == 4 && memcmp(from, "null", 4) == 0)) return OK;
    PyObject *t = Py_BuildValue("(nni)", from - s->start, s->p - s->start, kind);
    if (t == NULL || PyList_Append(s->recorded, t) != 0) {
        Py_XDECREF(t);
        return ERROR;
    }
    Py_DECREF(t);
    return OK;
}

static int skip_container(Scanner *s, int depth, unsigned char close) {
    if (depth > MAX_DEPTH) return MISFIT;
    s->p++;
    if (eat(s, close)) return OK;
    for (;;) {
        ws(s);
        if (close == '}') {
            if (skip_string(s) != OK || !eat(s, ':')) return MISFIT;
            ws(s);
        }
        int r = skip_value(s, depth);
        if (r != OK) return r;
        if (eat(s, ',')) continue;
        if (eat(s, close)) return OK;
        return MISFIT;
    }
}

/* Any JSON value at s->p (whitespace before it already skipped). */
static int skip_value(Scanner *s, int depth) {
    switch (peek(s)) {
    case '"': return skip_string(s);
    case '{': return skip_container(s, depth + 1, '}');
    case '[': return skip_container(s, depth + 1, ']');
    case 't': return literal(s, "true", 4);
    case 'f': return literal(s, "false", 5);
    case 'n': return literal(s, "null", 4);
    default: return finite_number(s);
    }
}

static int span_value(Scanner *s, int depth, Span *span) {
    ws(s);
    span->start = s->p - s->start;
    int r = skip_value(s, depth);
    span->end = s->p - s->start;
    return r;
}

/* A logprob value: a finite number as a double; anything else (null, a string, a bool, an
 * object) is NaN, as turnstile.proxy.capture._float has it. */
static int logprob(Scanner *s, int depth, double *out) {
    ws(s);
    int c = peek(s);
    if (c == '-' || (c >= '0' && c <= '9')) {
        const unsigned char *from;
        int integer;
        if (number(s, &from, &integer) != OK) return MISFIT;
        return to_double(from, s->p, integer, out);
    }
    *out = Py_NAN;
    return skip_value(s, depth);
}

/* A non-negative integer literal no larger than `max`. */
static int bounded_int(Scanner *s, long long max, long long *out) {
    ws(s);
    const unsigned char *p = s->p;
    long long v = 0;
    int n = 0;
    while (p < s->end && *p >= '0' && *p <= '9' && n <= MAX_ID_DIGITS) {
        v = v * 10 + (*p++ - '0');
        n++;
    }
    if (n == 0 || n > MAX_ID_DIGITS || v > max || (n > 1 && *s->p == '0')) return MISFIT;
    if (p < s->end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9')))
        return MISFIT;
    s->p = p;
    *out = v;
    return OK;
}

/* null (present = 0) or an array of token ids into `out` (present = 1). */
static int id_array(Scanner *s, Buf *out, int *present) {
    ws(s);
    if (peek(s) == 'n') {
        *present = 0;
        return literal(s, "null", 4);
    }
    if (peek(s) != '[') return MISFIT;
    s->p++;
    *present = 1;
    if (eat(s, ']')) return OK;
    /* The hot loop of a long prompt: digits, a comma, digits, ... with at most a few
     * spaces between; at most one id per two bytes, so the room is reserved up front. */
    Py_ssize_t room = (s->end - s->p) / 2 + 1;
    if (out->cap - out->len < room * 4) {
        Py_ssize_t cap = out->len + room * 4;
        char *data = PyMem_Realloc(out->data, (size_t)cap);
        if (data == NULL) {
            PyErr_NoMemory();
            return ERROR;
        }
        out->data = data;
        out->cap = cap;
    }
    const unsigned char *p = s->p, *end = s->end;
    char *dst = out->data + out->len;
    for (;;) {
        while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
        const unsigned char *digits = p;
        uint64_t v = 0;
        while (p < end && *p >= '0' && *p <= '9' && p - digits <= MAX_ID_DIGITS)
            v = v * 10 + (uint64_t)(*p++ - '0');
        Py_ssize_t n = p - digits;
        if (n == 0 || n > MAX_ID_DIGITS || v > (uint64_t)MAX_TOKEN_ID || (n > 1 && *digits == '0'))
            return MISFIT;
        if (p < end && (*p == '.' || *p == 'e' || *p == 'E' || (*p >= '0' && *p <= '9')))
            return MISFIT;
        int32_t id = (int32_t)v;
        memcpy(dst, &id, sizeof id);
        dst += sizeof id;
        while (p < end && (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t')) p++;
        if (p < end && *p == ',') {
            p++;
            continue;
        }
        out->len = dst - out->data;
        s->p = p;
        if (p < end && *p == ']') {
            s->p++;
            return OK;
        }
        return MISFIT;
    }
}

/* `id_array`, noting the value as recorded. */
static int noted_ids(Scanner *s, Buf *out, int *present) {
    ws(s);
    const unsigned char *from = s->p;
    int r = id_array(s, out, present);
    return r == OK ? note(s, from, RECORDED_IDS) : r;
}

/* Whether the escapes of the string [a, b) could decode to characters of `allowed` (then
 * its decoded text might be a key or a "token_id:N" the caller looks for). The simple
 * escapes (\\n, \\", ...) never decode to letters, digits, '_' or ':'. */
static int escapes_may_spell(const unsigned char *a, const unsigned char *b, const char *allowed) {
    for (const unsigned char *p = a; p < b; p++) {
        if (*p != '\\') continue;
        if (p[1] == 'u') {
            unsigned cp;
            if (hex4(p + 2, &cp) == 0 && cp < 128 && cp != 0 && strchr(allowed, (int)cp))
                return 1;
            p += 5;
        } else p++;
    }
    return 0;
}

#define KEY_CHARS "abcdefghijklmnopqrstuvwxyz_"
#define TOKEN_ID_CHARS "tokenid_:0123456789"

/* The key of an object member (no escapes allowed) and the colon after it. */
static int key(Scanner *s, const unsigned char **from, Py_ssize_t *len) {
    const unsigned char *a, *b;
    int escaped;
    ws(s);
    if (string(s, &a, &b, &escaped) != OK || !eat(s, ':')) return MISFIT;
    if (escaped) {
        /* an escaped key is some other key unless its escapes may spell a known one */
        if (escapes_may_spell(a, b, KEY_CHARS)) return MISFIT;
        a = b = (const unsigned char *)"";
    }
    *from = a;
    *len = b - a;
    return OK;
}

static inline int is_key(const unsigned char *k, Py_ssize_t n, const char *name) {
    return (Py_ssize_t)strlen(name) == n && memcmp(k, name, (size_t)n) == 0;
}

/* Marks a known key as seen; MISFIT on its second appearance. */
static inline int first_time(unsigned *seen, unsigned bit) {
    if (*seen & bit) return MISFIT;
    *seen |= bit;
    return OK;
}

/* Either `{` followed by members, or `}` at once: 1 when the object is empty. */
static int open_object(Scanner *s, int depth) {
    ws(s);
    if (depth > MAX_DEPTH || peek(s) != '{') return MISFIT;
    s->p++;
    return eat(s, '}') ? 1 : OK;
}

/* After a member: 1 for another, 0 at the end of the object. */
static int next_member(Scanner *s) {
    if (eat(s, ',')) return 1;
    if (eat(s, '}')) return 0;
    return MISFIT;
}

/* null (present = 0), or `[` (present = 1) then 1 per element via next_element. */
static int open_array(Scanner *s, int depth, int *present) {
    ws(s);
    if (peek(s) == 'n') {
        *present = 0;
        if (literal(s, "null", 4) != OK) return MISFIT;
        return 1; /* no elements */
    }
    if (depth > MAX_DEPTH || peek(s) != '[') return MISFIT;
    s->p++;
    *present = 1;
    return eat(s, ']') ? 1 : OK;
}

static int next_element(Scanner *s) {
    if (eat(s, ',')) return 1;
    if (eat(s, ']')) return 0;
    return MISFIT;
}

/* -- one choice ----------------------------------------------------------------------- */
typedef struct {
    int completions;   /* the completions shapes, else chat */
    int tokens_as_ids; /* top-k tokens come as "token_id:N" and are recorded */
} Mode;

typedef struct {
    long long index;
    Buf ids, prompt, logprobs, top_counts, top_ids, top_values;
    int has_ids, has_prompt, has_logprobs, has_tops;
    Span message, delta, text, finish, stop;
} Choice;

static void choice_reset(Choice *c) {
    c->index = 0;
    c->ids.len = c->prompt.len = c->logprobs.len = 0;
    c->top_counts.len = c->top_ids.len = c->top_values.len = 0;
    c->has_ids = c->has_prompt = c->has_logprobs = c->has_tops = 0;
    c->message.start = c->delta.start = c->text.start = -1;
    c->finish.start = c->stop.start = -1;
}

static void choice_free(Choice *c) {
    buf_free(&c->ids);
    buf_free(&c->prompt);
    buf_free(&c->logprobs);
    buf_free(&c->top_counts);
    buf_free(&c->top_ids);
    buf_free(&c->top_values);
}

static int push_logprob(Choice *c, double value) {
    float f = (float)value;
    if (f == f && f - f != 0.0f) return MISFIT; /* beyond float32: the slow path refuses */
    c->has_logprobs = 1;
    return buf_push(&c->logprobs, &f, sizeof f) != 0 ? ERROR : OK;
}

/* A top-k token: 1 with its id when it is "token_id:N", 0 when it is anything else. */
static int top_token(Scanner *s, int depth, long long *id) {
    ws(s);
    if (peek(s) != '"') return skip_value(s, depth) == OK ? 0 : MISFIT;
    const unsigned char *a, *b;
    int escaped;
    if (string(s, &a, &b, &escaped) != OK) return MISFIT;
    if (escaped) /* not "token_id:N", unless its escapes may spell part of that */
        return escapes_may_spell(a, b, TOKEN_ID_CHARS) ? MISFIT : 0;
    if (b - a < ID_PREFIX_LEN || memcmp(a, ID_PREFIX, ID_PREFIX_LEN) != 0) return 0;
    a += ID_PREFIX_LEN;
    if (a == b) return 0;
    long long v = 0;
    for (const unsigned char *p = a; p < b; p++) {
        if (*p < '0' || *p > '9') return 0;
        if (b - a > MAX_ID_DIGITS) continue; /* refused below, by the slow path */
        v = v * 10 + (*p - '0');
    }
    if (b - a > MAX_ID_DIGITS || v > MAX_TOKEN_ID) return MISFIT; /* the slow path refuses */
    *id = v;
    return 1;
}

static int push_top(Choice *c, long long id, double value) {
    int64_t i = id;
    float f = (float)value; /* written as float32: beyond it, the slow path refuses */
    if (f == f && f - f != 0.0f) return MISFIT;
    if (buf_push(&c->top_ids, &i, sizeof i) != 0) return ERROR;
    if (buf_push(&c->top_values, &value, sizeof value) != 0) return ERROR;
    return OK;
}

/* One chat `top_logprobs` entry: {token, logprob}. Adds to the row when recorded. */
static int chat_top(Scanner *s, int depth, Choice *c, int record, int64_t *row) {
    int r = open_object(s, depth);
    if (r < 0) return MISFIT;
    unsigned seen = 0;
    int is_id = 0;
    long long id = 0;
    double value = Py_NAN;
    while (r == OK) {
        const unsigned char *k;
        Py_ssize_t n;
        if (key(s, &k, &n) != OK) return MISFIT;
        if (is_key(k, n, "token")) {
            if (first_time(&seen, 1) != OK) return MISFIT;
            is_id = top_token(s, depth + 1, &id);
            if (is_id < 0) return MISFIT;
        } else if (is_key(k, n, "logprob")) {
            if (first_time(&seen, 2) != OK) return MISFIT;
            if (logprob(s, depth + 1, &value) != OK) return MISFIT;
        } else {
            ws(s);
            if (skip_value(s, depth + 1) != OK) return MISFIT;
        }
        r = next_member(s);
        if (r < 0) return MISFIT;
        r = r == 1 ? OK : 1;
    }
    if (record && is_id) {
        (*row)++;
        return push_top(c, id, value);
    }
    return OK;
}

/* One entry of a chat answer's `logprobs.content`: {logprob, top_logprobs, ...}. */
static int chat_entry(Scanner *s, int depth, Choice *c, const Mode *mode) {
    int r = open_object(s, depth);
    if (r < 0) return MISFIT;
    unsigned seen = 0;
    double value = Py_NAN;
    int64_t row = 0;
    int tops = 0; /* a non-empty top_logprobs list */
    while (r == OK) {
        const unsigned char *k;
        Py_ssize_t n;
        if (key(s, &k, &n) != OK) return MISFIT;
        if (is_key(k, n, "logprob")) {
            if (first_time(&seen, 1) != OK) return MISFIT;
            if (logprob(s, depth + 1, &value) != OK) return MISFIT;
        } else if (is_key(k, n, "top_logprobs")) {
            if (first_time(&seen, 2) != OK) return MISFIT;
            int present;
            int e = open_array(s, depth + 1, &present);
            if (e < 0) return MISFIT;
            while (e == OK) {
                tops = 1;
                int t = chat_top(s, depth + 2, c, !mode->completions && mode->tokens_as_ids, &row);
                if (t != OK) return t;
                e = next_element(s);
                if (e < 0) return MISFIT;
                e = e == 1 ? OK : 1;
            }
        } else {
            ws(s);
            if (skip_value(s, depth + 1) != OK) return MISFIT;
        }
        r = next_member(s);
        if (r < 0) return MISFIT;
        r = r == 1 ? OK : 1;
    }
    if (!mode->completions) {
        r = push_logprob(c, value);
        if (r != OK) return r;
        if (mode->tokens_as_ids && tops) {
            c->has_tops = 1;
            if (buf_push(&c->top_counts, &row, sizeof row) != 0) return ERROR;
        }
    }
    return OK;
}

/* One element of a completions answer's `logprobs.top_logprobs`: {token: logprob} or
 * anything else (an empty row). */
static int completion_top(Scanner *s, int depth, Choice *c, int record) {
    int64_t row = 0;
    ws(s);
    if (peek(s) != '{') {
        if (skip_value(s, depth) != OK) return MISFIT;
    } else {
        const unsigned char *keys[64];
        Py_ssize_t lens[64];
        int nkeys = 0;
        int r = open_object(s, depth);
        if (r < 0) return MISFIT;
        while (r == OK) {
            const unsigned char *a, *b;
            int escaped;
            ws(s);
            if (string(s, &a, &b, &escaped) != OK || !eat(s, ':')) return MISFIT;
            if (!record) { /* validated only */
                ws(s);
                if (skip_value(s, depth + 1) != OK) return MISFIT;
            } else {
                /* a token twice, or one spelled with escapes, is left to the slow path */
                if (escaped || nkeys == 64) return MISFIT; /* vLLM sends at most 20 */
                for (int i = 0; i < nkeys; i++)
                    if (lens[i] == b - a && memcmp(keys[i], a, (size_t)(b - a)) == 0)
                        return MISFIT;
                keys[nkeys] = a;
                lens[nkeys++] = b - a;
                double value;
                if (logprob(s, depth + 1, &value) != OK) return MISFIT;
                /* the key as a top-k token: re-scan it as a string */
                Scanner t = {s->start, a - 1, b + 1, NULL};
                long long id;
                int is_id = top_token(&t, depth + 1, &id);
                if (is_id < 0) return MISFIT;
                if (is_id) {
                    row++;
                    int t = push_top(c, id, value);
                    if (t != OK) return t;
                }
            }
            r = next_member(s);
            if (r < 0) return MISFIT;
            r = r == 1 ? OK : 1;
        }
    }
    if (record && buf_push(&c->top_counts, &row, sizeof row) != 0) return ERROR;
    return OK;
}

/* A choice's `logprobs`: null or {content, token_logprobs, top_logprobs, ...}. */
static int logprobs_object(Scanner *s, int depth, Choice *c, const Mode *mode) {
    ws(s);
    if (peek(s) == 'n') return literal(s, "null", 4);
    int r = open_object(s, depth);
    if (r < 0) return MISFIT;
    unsigned seen = 0;
    while (r == OK) {
        const unsigned char *k;
        Py_ssize_t n;
        int present, e;
        if (key(s, &k, &n) != OK) return MISFIT;
        if (is_key(k, n, "content")) {
            if (first_time(&seen, 1) != OK) return MISFIT;
            e = open_array(s, depth + 1, &present);
            if (e < 0) return MISFIT;
            while (e == OK) {
                int t = chat_entry(s, depth + 2, c, mode);
                if (t != OK) return t;
                e = next_element(s);
                if (e < 0) return MISFIT;
                e = e == 1 ? OK : 1;
            }
        } else if (is_key(k, n, "token_logprobs")) {
            if (first_time(&seen, 2) != OK) return MISFIT;
            e = open_array(s, depth + 1, &present);
            if (e < 0) return MISFIT;
            while (e == OK) {
                double value;
                if (logprob(s, depth + 2, &value) != OK) return MISFIT;
                if (mode->completions) {
                    int t = push_logprob(c, value);
                    if (t != OK) return t;
                }
                e = next_element(s);
                if (e < 0) return MISFIT;
                e = e == 1 ? OK : 1;
            }
        } else if (is_key(k, n, "top_logprobs")) {
            if (first_time(&seen, 4) != OK) return MISFIT;
            e = open_array(s, depth + 1, &present);
            if (e < 0) return MISFIT;
            int record = mode->completions && mode->tokens_as_ids;
            if (record && present) c->has_tops = 1;
            while (e == OK) {
                int t = completion_top(s, depth + 2, c, record);
                if (t != OK) return t;
                e = next_element(s);
                if (e < 0) return MISFIT;
                e = e == 1 ? OK : 1;
            }
        } else {
            ws(s);
            if (skip_value(s, depth + 1) != OK) return MISFIT;
        }
        r = next_member(s);
        if (r < 0) return MISFIT;
        r = r == 1 ? OK : 1;
    }
    return OK;
}

static int choice(Scanner *s, int depth, Choice *c, const Mode *mode) {
    int r = open_object(s, depth);
    if (r < 0) return MISFIT;
    unsigned seen = 0;
    while (r == OK) {
        const unsigned char *k;
        Py_ssize_t n;
        int t = OK;
        if (key(s, &k, &n) != OK) return MISFIT;
        if (is_key(k, n, "index")) {
            t = first_time(&seen, 1);
            if (t == OK) t = bounded_int(s, MAX_CHOICE_INDEX, &c->index);
        } else if (is_key(k, n, "token_ids")) {
            t = first_time(&seen, 2);
            if (t == OK) t = noted_ids(s, &c->ids, &c->has_ids);
        } else if (is_key(k, n, "prompt_token_ids")) {
            t = first_time(&seen, 4);
            if (t == OK) t = noted_ids(s, &c->prompt, &c->has_prompt);
        } else if (is_key(k, n, "logprobs")) {
            t = first_time(&seen, 8);
            if (t == OK) {
                ws(s);
                const unsigned char *from = s->p;
                t = logprobs_object(s, depth + 1, c, mode);
                if (t == OK) t = note(s, from, RECORDED_LOGPROBS);
            }
        } else if (is_key(k, n, "message")) {
            t = first_time(&seen, 16);
            if (t == OK) t = span_value(s, depth + 1, &c->message);
        } else if (is_key(k, n, "delta")) {
            t = first_time(&seen, 32);
            if (t == OK) t = span_value(s, depth + 1, &c->delta);
        } else if (is_key(k, n, "text")) {
            t = first_time(&seen, 64);
            if (t == OK) t = span_value(s, depth + 1, &c->text);
        } else if (is_key(k, n, "finish_reason")) {
            t = first_time(&seen, 128);
            if (t == OK) t = span_value(s, depth + 1, &c->finish);
        } else if (is_key(k, n, "stop_reason")) {
            t = first_time(&seen, 256);
            if (t == OK) t = span_value(s, depth + 1, &c->stop);
        } else {
            ws(s);
            t = skip_value(s, depth + 1);
        }
        if (t != OK) return t;
        r = next_member(s);
        if (r < 0) return MISFIT;
        r = r == 1 ? OK : 1;
    }
    return OK;
}

static PyObject *span_object(const Span *span) {
    if (span->start < 0) Py_RETURN_NONE;
    return Py_BuildValue("(nn)", span->start, span->end);
}

/* A field's value where it is cheap to make here: None for null (or absent), a str for a
 * string without escapes; else the (start, end) span for the caller to decode. */
static PyObject *value_object(const unsigned char *base, const Span *span) {
    if (span->start < 0) Py_RETURN_NONE;
    const unsigned char *a = base + span->start, *b = base + span->end;
    if (b - a == 4 && memcmp(a, "null", 4) == 0) Py_RETURN_NONE;
    if (b - a >= 2 && *a == '"' && memchr(a + 1, '\\', (size_t)(b - a - 2)) == NULL)
        return PyUnicode_DecodeUTF8((const char *)a + 1, b - a - 2, NULL);
    return span_object(span);
}

/* The Python tuple of one scanned choice. */
static PyObject *choice_tuple(const unsigned char *base, Choice *c) {
    return Py_BuildValue(
        "(LNNNNNNNNNNN)", c->index, buf_take(&c->ids, c->has_ids),
        buf_take(&c->prompt, c->has_prompt), buf_take(&c->logprobs, c->has_logprobs),
        buf_take(&c->top_counts, c->has_tops), buf_take(&c->top_ids, c->has_tops),
        buf_take(&c->top_values, c->has_tops), span_object(&c->message),
        span_object(&c->delta), value_object(base, &c->text), value_object(base, &c->finish),
        value_object(base, &c->stop));
}

/* -- the whole answer ------------------------------------------------------------------- */
typedef struct {
    Buf prompt;
    int has_prompt;
    Span model, usage, error;
    int has_choices;
    PyObject *choices; /* list of choice tuples */
} Answer;

/* The choice indices seen so far: a few in a list, a bitmap past that (allocated only for
 * answers with many choices, so that a one-token stream chunk costs no allocation). */
#define FEW_CHOICES 16
typedef struct {
    long long few[FEW_CHOICES];
    int count;
    unsigned char *bitmap;
} Indices;

/* 1 when `index` was seen before (then the slow path merges the choices), 0 after noting
 * it, ERROR without memory. */
static int seen_before(Indices *seen, long long index) {
    if (seen->bitmap == NULL) {
        for (int i = 0; i < seen->count; i++)
            if (seen->few[i] == index) return 1;
        if (seen->count < FEW_CHOICES) {
            seen->few[seen->count++] = index;
            return 0;
        }
        seen->bitmap = PyMem_Calloc(MAX_CHOICE_INDEX + 1, 1);
        if (seen->bitmap == NULL) {
            PyErr_NoMemory();
            return ERROR;
        }
        for (int i = 0; i < seen->count; i++) seen->bitmap[seen->few[i]] = 1;
    }
    if (seen->bitmap[index]) return 1;
    seen->bitmap[index] = 1;
    return 0;
}

static int answer(Scanner *s, Answer *a, const Mode *mode, Indices *indices) {
    int r = open_object(s, 0);
    if (r < 0) return MISFIT;
    unsigned seen = 0;
    Choice c;
    memset(&c, 0, sizeof c);
    int result = OK;
    while (r == OK) {
        const unsigned char *k;
        Py_ssize_t n;
        int t = OK;
        if (key(s, &k, &n) != OK) {
            result = MISFIT;
            break;
        }
        if (is_key(k, n, "prompt_token_ids")) {
            t = first_time(&seen, 1);
            if (t == OK) t = noted_ids(s, &a->prompt, &a->has_prompt);
        } else if (is_key(k, n, "model")) {
            t = first_time(&seen, 2);
            if (t == OK) t = span_value(s, 1, &a->model);
        } else if (is_key(k, n, "usage")) {
            t = first_time(&seen, 4);
            if (t == OK) t = span_value(s, 1, &a->usage);
        } else if (is_key(k, n, "error")) {
            t = first_time(&seen, 8);
            if (t == OK) t = span_value(s, 1, &a->error);
        } else if (is_key(k, n, "choices")) {
            t = first_time(&seen, 16);
            int e = t == OK ? open_array(s, 1, &a->has_choices) : MISFIT;
            if (e < 0) t = MISFIT;
            while (t == OK && e == OK) {
                choice_reset(&c);
                t = choice(s, 2, &c, mode);
                if (t != OK) break;
                int again = seen_before(indices, c.index);
                if (again != 0) {
                    t = again == 1 ? MISFIT : ERROR; /* one index twice: the slow path */
                    break;
                }
                PyObject *tuple = choice_tuple(s->start, &c);
                if (tuple == NULL || PyList_Append(a->choices, tuple) != 0) {
                    Py_XDECREF(tuple);
                    t = ERROR;
                    break;
                }
                Py_DECREF(tuple);
                e = next_element(s);
                if (e < 0) t = MISFIT;
                e = e == 1 ? OK : 1;
            }
        } else {
            ws(s);
            t = skip_value(s, 1);
        }
        if (t != OK) {
            result = t;
            break;
        }
        r = next_member(s);
        if (r < 0) {
            result = MISFIT;
            break;
        }
        r = r == 1 ? OK : 1;
    }
    choice_free(&c);
    if (result != OK) return result;
    ws(s);
    return s->p == s->end ? OK : MISFIT;
}

PyDoc_STRVAR(scan_doc,
             "scan(body, completions, tokens_as_ids) -> tuple | None\n\n"
             "The recorded fields of a whole answer or of one stream chunk, or None where the\n"
             "body is not exactly the expected shape (decode it the slow way).\n\n"
             "Returns (prompt_ids, model, usage, error, choices, recorded): token arrays are bytearrays\n"
             "of native int32 (ids), float32 (logprobs), int64 (top-k counts and ids) and\n"
             "float64 (top-k values), or None where absent. model, usage, text,\n"
             "finish_reason and stop_reason are None (null or absent), a str (a string\n"
             "without escapes) or the (start, end) byte offsets of their JSON value; error,\n"
             "message and delta are offsets, or None. `choices` is None when the body had\n"
             "none (absent or null), else a list of (index, token_ids, prompt_token_ids,\n"
             "logprobs, top_counts, top_ids, top_values, message, delta, text,\n"
             "finish_reason, stop_reason). Last, `recorded`: the (start, end, kind) of every\n"
             "non-null value a client that did not ask for it must not see: kind 0 for\n"
             "prompt_token_ids and token_ids, 1 for a choice's logprobs.");

static PyObject *scan(PyObject *module, PyObject *args) {
    (void)module;
    Py_buffer view;
    int completions, tokens_as_ids;
    if (!PyArg_ParseTuple(args, "y*pp:scan", &view, &completions, &tokens_as_ids)) return NULL;
    Mode mode = {completions, tokens_as_ids};
    Scanner s = {view.buf, view.buf, (const unsigned char *)view.buf + view.len, PyList_New(0)};
    Answer a;
    memset(&a, 0, sizeof a);
    a.model.start = a.usage.start = a.error.start = -1;
    a.choices = PyList_New(0);
    Indices indices;
    indices.count = 0;
    indices.bitmap = NULL;
    PyObject *result = NULL;
    if (a.choices == NULL || s.recorded == NULL) goto done;
    int r = answer(&s, &a, &mode, &indices);
    if (r == ERROR) goto done;
    if (r == MISFIT) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *choices = a.has_choices ? Py_NewRef(a.choices) : Py_NewRef(Py_None);
    result = Py_BuildValue("(NNNNNO)", buf_take(&a.prompt, a.has_prompt),
                           value_object(s.start, &a.model), value_object(s.start, &a.usage),
                           span_object(&a.error), choices, s.recorded);
done:
    PyMem_Free(indices.bitmap);
    buf_free(&a.prompt);
    Py_XDECREF(a.choices);
    Py_XDECREF(s.recorded);
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"scan", scan, METH_VARARGS, scan_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_tokenscan",
    "The recorded fields of a vLLM answer, straight from its bytes (see _tokenscan.c).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__tokenscan(void) { return PyModule_Create(&module); }
