/*
 * install-test.c - scripts/install and the packaging it installs, staged:
 * `scripts/install --destdir TMP` into a temporary tree (never the real
 * system), the tree it makes, the systemd unit and the tmpfiles.d entry
 * checked offline (tests/check-unit, systemd-tmpfiles --root), the
 * AppArmor rules compiled without loading them (tests/check-apparmor),
 * and `--uninstall` leaving exactly the tree that was there before.
 *
 * QEMU_BINARY (scripts/run-tests sets it) is installed when set, and then
 * the installed copy must find its firmware; otherwise a stand-in
 * executable is, with --no-qemu-check.  Needs meson and python3 (as
 * scripts/install does), not root.
 */
#include <errno.h>
#include <ftw.h>
#include <glib.h>
#include <glib/gstdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* The exit status that means "nothing to check on this host". */
#define SKIP_STATUS 77

typedef struct {
    char *tmp;      /* holds the staging tree and the stand-in QEMU */
    char *root;     /* the staging tree (--destdir) */
    char *qemu;     /* what --qemu gets */
    gboolean real_qemu;
    char *prefix;
    char *before;   /* the tree's listing before the installation */
    gboolean installed;
} Fixture;

static const char *
env(const char *name)
{
    const char *v = g_getenv(name);

    if (v == NULL) {
        g_error("%s is not set (run through meson test)", name);
    }
    return v;
}

/* Runs argv; returns its exit status (-1: killed), output in *out. */
static int
run(char **out, const char *first, ...)
{
    g_autoptr(GPtrArray) argv = g_ptr_array_new();
    g_autoptr(GError) error = NULL;
    g_autofree char *o = NULL, *e = NULL;
    int status = 0;
    va_list ap;

    va_start(ap, first);
    for (const char *a = first; a != NULL; a = va_arg(ap, const char *)) {
        g_ptr_array_add(argv, (char *)a);
    }
    va_end(ap);
    g_ptr_array_add(argv, NULL);
    if (!g_spawn_sync(NULL, (char **)argv->pdata, NULL, G_SPAWN_SEARCH_PATH, NULL, NULL, &o,
                      &e, &status, &error)) {
        g_error("cannot run %s: %s", first, error->message);
    }
    if (out != NULL) {
        *out = g_strconcat(o, e, NULL);
    }
    if (WIFEXITED(status)) {
        return WEXITSTATUS(status);
    }
    return -1;
}

/* ---- the tree, listed: one line per entry below the root ---- */

static GPtrArray *listing;
static size_t listing_skip;

static int
list_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    const char *rel = path + listing_skip;
    char target[4096] = "";

    if (*rel == '\0') {
        return 0;
    }
    if (S_ISLNK(st->st_mode)) {
        ssize_t n = readlink(path, target, sizeof(target) - 1);

        target[n > 0 ? n : 0] = '\0';
    }
    g_ptr_array_add(listing, g_strdup_printf("%s %o %lld %s", rel, (unsigned)st->st_mode,
                                             S_ISREG(st->st_mode) ? (long long)st->st_size : 0LL,
                                             target));
    return 0;
}

static int
cmp_str(gconstpointer a, gconstpointer b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static char *
list_tree(const char *root)
{
    g_autoptr(GPtrArray) l = g_ptr_array_new_with_free_func(g_free);

    listing = l;
    listing_skip = strlen(root);
    g_assert_cmpint(nftw(root, list_one, 16, FTW_PHYS), ==, 0);
    g_ptr_array_sort(l, cmp_str);
    g_ptr_array_add(l, NULL);
    listing = NULL;
    return g_strjoinv("\n", (char **)l->pdata);
}

static int
rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw)
{
    return remove(path) == 0 || errno == ENOENT ? 0 : -1;
}

/* ---- staging ---- */

static char *
at(Fixture *f, const char *path)
{
    return g_build_filename(f->root, path, NULL);
}

static char *
read_file(Fixture *f, const char *path)
{
    g_autofree char *p = at(f, path);
    g_autoptr(GError) error = NULL;
    char *text = NULL;

    g_file_get_contents(p, &text, NULL, &error);
    g_assert_no_error(error);
    return text;
}

static void
write_file(Fixture *f, const char *path, const char *text)
{
    g_autofree char *p = at(f, path);
    g_autofree char *dir = g_path_get_dirname(p);
    g_autoptr(GError) error = NULL;

    g_assert_cmpint(g_mkdir_with_parents(dir, 0755), ==, 0);
    g_file_set_contents(p, text, -1, &error);
    g_assert_no_error(error);
}

static int
install(Fixture *f, char **out, gboolean uninstall)
{
    const char *script = NULL;
    g_autofree char *path = g_build_filename(env("PAGEFOLD_SOURCE_DIR"), "scripts", "install",
                                             NULL);

    script = path;
    if (uninstall) {
        return run(out, script, "--uninstall", "--destdir", f->root, "--build-dir",
                   env("PAGEFOLD_BUILD_DIR"), NULL);
    }
    return run(out, script, "--destdir", f->root, "--build-dir", env("PAGEFOLD_BUILD_DIR"),
               "--qemu", f->qemu, f->real_qemu ? NULL : "--no-qemu-check", NULL);
}

/* What a site already has, which the installation must leave as it is. */
static void
site_files(Fixture *f)
{
    write_file(f, "etc/apparmor.d/local/abstractions/libvirt-qemu",
               "# Site-specific additions and overrides for libvirt-qemu\n"
               "  /srv/images/** rk,\n");
    write_file(f, "etc/apparmor.d/local/usr.sbin.libvirtd", "");
    write_file(f, "etc/libvirt/hooks/qemu", "#!/bin/sh\n# someone else's dispatcher\n");
    write_file(f, "etc/libvirt/hooks/qemu.d/00-other", "#!/bin/sh\nexit 0\n");
}

static void
setup(Fixture *f, gconstpointer data)
{
    g_autoptr(GError) error = NULL;
    g_autofree char *out = NULL;
    const char *qemu = g_getenv("QEMU_BINARY");
    g_autofree char *meson = g_find_program_in_path("meson");
    g_autofree char *python3 = g_find_program_in_path("python3");
    int rc;

    if (meson == NULL || python3 == NULL) {
        return; /* the test skips */
    }
    f->tmp = g_dir_make_tmp("pagefold-install-XXXXXX", &error);
    g_assert_no_error(error);
    f->root = g_build_filename(f->tmp, "root", NULL);
    g_assert_cmpint(g_mkdir(f->root, 0755), ==, 0);
    f->prefix = g_strdup(env("PAGEFOLD_PREFIX"));
    if (qemu != NULL && g_file_test(qemu, G_FILE_TEST_IS_EXECUTABLE)) {
        f->qemu = g_strdup(qemu);
        f->real_qemu = TRUE;
    } else {
        f->qemu = g_build_filename(f->tmp, "qemu-system-x86_64", NULL);
        g_file_set_contents(f->qemu, "#!/bin/sh\necho 'a stand-in QEMU'\n", -1, &error);
        g_assert_no_error(error);
        g_assert_cmpint(g_chmod(f->qemu, 0755), ==, 0);
    }
    site_files(f);
    f->before = list_tree(f->root);
    rc = install(f, &out, FALSE);
    g_test_message("scripts/install --destdir %s: %s", f->root, out);
    g_assert_cmpint(rc, ==, 0);
    f->installed = TRUE;
}

static void
teardown(Fixture *f, gconstpointer data)
{
    if (f->installed) {
        g_autofree char *out = NULL;

        install(f, &out, TRUE);
    }
    if (f->tmp != NULL) {
        nftw(f->tmp, rm_one, 16, FTW_DEPTH | FTW_PHYS);
    }
    g_free(f->tmp);
    g_free(f->root);
    g_free(f->qemu);
    g_free(f->prefix);
    g_free(f->before);
}

static gboolean
skipped(Fixture *f)
{
    if (f->root == NULL) {
        g_test_skip("scripts/install needs meson and python3 in PATH");
        return TRUE;
    }
    return FALSE;
}

/* The manifest's entries of a kind, as paths on the target system. */
static GPtrArray *
manifest(Fixture *f, const char *kind)
{
    g_autofree char *mpath = g_build_filename(f->prefix, "lib/pagefold/install-manifest", NULL);
    g_autofree char *text = read_file(f, mpath);
    g_auto(GStrv) lines = g_strsplit(text, "\n", -1);
    g_autofree char *want = g_strconcat(kind, " ", NULL);
    GPtrArray *paths = g_ptr_array_new_with_free_func(g_free);

    for (char **l = lines; *l; l++) {
        if (g_str_has_prefix(*l, want)) {
            g_ptr_array_add(paths, g_strdup(*l + strlen(want)));
        }
    }
    return paths;
}

static gboolean
listed(GPtrArray *paths, const char *path)
{
    for (guint i = 0; i < paths->len; i++) {
        if (g_str_equal(g_ptr_array_index(paths, i), path)) {
            return TRUE;
        }
    }
    return FALSE;
}

/* An installed file: in the tree, and in the manifest as kind. */
static void
assert_installed(Fixture *f, const char *kind, const char *path, gboolean executable)
{
    g_autoptr(GPtrArray) entries = manifest(f, kind);
    g_autofree char *p = at(f, path);
    struct stat st;

    g_assert_cmpint(lstat(p, &st), ==, 0);
    if (!listed(entries, path)) {
        g_error("%s is not in the manifest as '%s'", path, kind);
    }
    if (g_str_equal(kind, "link")) {
        g_assert_true(S_ISLNK(st.st_mode));
    } else if (g_str_equal(kind, "file")) {
        g_assert_true(S_ISREG(st.st_mode));
    }
    if (executable) {
        g_assert_true(g_file_test(p, G_FILE_TEST_IS_EXECUTABLE));
    }
}

static void
assert_link(Fixture *f, const char *path, const char *target)
{
    g_autofree char *p = at(f, path);
    g_autofree char *t = g_file_read_link(p, NULL);

    g_assert_cmpstr(t, ==, target);
    assert_installed(f, "link", path, FALSE);
}

static guint
count_lines(const char *text, const char *line)
{
    g_auto(GStrv) lines = g_strsplit(text, "\n", -1);
    guint n = 0;

    for (char **l = lines; *l; l++) {
        n += g_str_equal(*l, line);
    }
    return n;
}

/* Finds the one manifest entry of a kind whose path ends with suffix. */
static char *
find_entry(Fixture *f, const char *kind, const char *suffix)
{
    g_autoptr(GPtrArray) entries = manifest(f, kind);

    for (guint i = 0; i < entries->len; i++) {
        if (g_str_has_suffix(g_ptr_array_index(entries, i), suffix)) {
            return g_strdup(g_ptr_array_index(entries, i));
        }
    }
    g_error("no %s ending in %s in the manifest", kind, suffix);
}

/* Everything the installation made, then the uninstallation. */
static void
test_tree(Fixture *f, gconstpointer data)
{
    g_autofree char *pagefoldd = NULL, *pagefoldctl = NULL, *hook = NULL, *qemu = NULL;
    g_autofree char *qemu_link = NULL, *bundle = NULL, *unit = NULL, *tmpfiles = NULL;
    g_autofree char *unit_text = NULL, *exec_start = NULL, *tmpfiles_text = NULL;
    g_autofree char *aa_qemu = NULL, *aa_libvirtd = NULL, *dispatcher = NULL;
    g_autofree char *installed = NULL, *again = NULL, *after = NULL, *out = NULL;
    g_autoptr(GPtrArray) lines = NULL, newfiles = NULL, dirs = NULL;

    if (skipped(f)) {
        return;
    }
    pagefoldd = g_build_filename(f->prefix, "sbin", "pagefoldd", NULL);
    pagefoldctl = g_build_filename(f->prefix, "bin", "pagefoldctl", NULL);
    hook = g_build_filename(f->prefix, "libexec", "pagefold-libvirt-hook", NULL);
    qemu = g_build_filename(f->prefix, "lib", "pagefold", "qemu", "qemu-system-x86_64", NULL);
    qemu_link = g_build_filename(f->prefix, "bin", "qemu-system-x86_64-pagefold", NULL);
    bundle = g_build_filename(f->prefix, "lib", "pagefold", "qemu", "qemu-bundle", NULL);

    /* pagefold's own programs and the hook. */
    assert_installed(f, "file", pagefoldd, TRUE);
    assert_installed(f, "file", pagefoldctl, TRUE);
    assert_installed(f, "file", hook, TRUE);

    /* The unit, for this prefix, with the agent socket's group. */
    unit = find_entry(f, "file", "/pagefoldd.service");
    unit_text = read_file(f, unit);
    exec_start = g_strdup_printf("ExecStart=%s --agent-group libvirt-qemu", pagefoldd);
    g_assert_cmpuint(count_lines(unit_text, exec_start), ==, 1);
    g_assert_cmpuint(count_lines(unit_text, "Type=notify"), ==, 1);
    g_assert_cmpuint(count_lines(unit_text, "Restart=on-failure"), ==, 1);
    {
        g_autofree char *reload = g_strdup_printf("ExecReload=%s reload", pagefoldctl);

        g_assert_cmpuint(count_lines(unit_text, reload), ==, 1);
    }
    g_assert_cmpuint(count_lines(unit_text, "DeviceAllow=/dev/userfaultfd rw"), ==, 1);
    g_assert_null(strstr(unit_text, "\nProtectProc="));
    g_assert_null(strstr(unit_text, "\nProcSubset="));
    tmpfiles = find_entry(f, "file", "tmpfiles.d/pagefold.conf");
    tmpfiles_text = read_file(f, tmpfiles);
    g_assert_cmpuint(count_lines(tmpfiles_text, "d /run/pagefold 0755 root root -"), ==, 1);

    /* AppArmor: the rules, and one marked include line each, after what
     * the site had. */
    assert_installed(f, "file", "/etc/apparmor.d/abstractions/pagefold-qemu", FALSE);
    assert_installed(f, "file", "/etc/apparmor.d/abstractions/pagefold-libvirtd", FALSE);
    aa_qemu = read_file(f, "etc/apparmor.d/local/abstractions/libvirt-qemu");
    g_assert_true(g_str_has_prefix(aa_qemu, "# Site-specific additions and overrides for "
                                            "libvirt-qemu\n  /srv/images/** rk,\n"));
    g_assert_cmpuint(count_lines(aa_qemu, "include if exists <abstractions/pagefold-qemu>"), ==,
                     1);
    aa_libvirtd = read_file(f, "etc/apparmor.d/local/usr.sbin.libvirtd");
    g_assert_cmpuint(
        count_lines(aa_libvirtd, "include if exists <abstractions/pagefold-libvirtd>"), ==, 1);
    lines = manifest(f, "line");
    g_assert_true(listed(lines, "/etc/apparmor.d/local/abstractions/libvirt-qemu"));
    g_assert_true(listed(lines, "/etc/apparmor.d/local/usr.sbin.libvirtd"));
    /* The site's files are not the installation's. */
    newfiles = manifest(f, "newfile");
    g_assert_cmpuint(newfiles->len, ==, 0);

    /* The hook: a link in qemu.d; the dispatcher as it was. */
    assert_link(f, "/etc/libvirt/hooks/qemu.d/pagefold", hook);
    dispatcher = read_file(f, "etc/libvirt/hooks/qemu");
    g_assert_cmpstr(dispatcher, ==, "#!/bin/sh\n# someone else's dispatcher\n");

    /* The patched QEMU, where <emulator> can point, and its firmware. */
    assert_installed(f, "file", qemu, TRUE);
    assert_link(f, qemu_link, qemu);
    dirs = manifest(f, "dir");
    g_assert_true(listed(dirs, bundle));
    if (g_file_test("/usr/share/seabios/bios-256k.bin", G_FILE_TEST_EXISTS)) {
        g_autofree char *bios = find_entry(f, "link", "/share/qemu/bios-256k.bin");
        g_autofree char *p = at(f, bios);

        g_assert_true(g_str_has_prefix(bios, bundle));
        /* It resolves on this host, where the firmware packages are. */
        g_assert_true(g_file_test(p, G_FILE_TEST_IS_REGULAR));
    } else {
        g_test_message("no /usr/share/seabios here: firmware links not checked");
    }
    if (f->real_qemu) {
        g_autofree char *q = at(f, qemu);
        g_autofree char *qout = NULL;

        /* The data directories it searches are in its bundle. */
        g_assert_cmpint(run(&qout, q, "-L", "help", NULL), ==, 0);
        g_test_message("%s -L help: %s", q, qout);
        g_assert_nonnull(strstr(qout, "/qemu-bundle/"));
    }

    /* Every entry of the manifest is there. */
    for (const char *const *k = (const char *const[]){ "file", "link", "dir", NULL }; *k; k++) {
        g_autoptr(GPtrArray) entries = manifest(f, *k);

        g_assert_cmpuint(entries->len, >, 0);
        for (guint i = 0; i < entries->len; i++) {
            g_autofree char *p = at(f, g_ptr_array_index(entries, i));
            struct stat st;

            if (lstat(p, &st) != 0) {
                g_error("%s (%s in the manifest) is missing", p, *k);
            }
        }
    }

    /* Installing again changes nothing. */
    installed = list_tree(f->root);
    g_assert_cmpint(install(f, &out, FALSE), ==, 0);
    again = list_tree(f->root);
    g_assert_cmpstr(again, ==, installed);

    /* Uninstalling leaves the tree as it was before. */
    g_clear_pointer(&out, g_free);
    g_assert_cmpint(install(f, &out, TRUE), ==, 0);
    f->installed = FALSE;
    after = list_tree(f->root);
    g_assert_cmpstr(after, ==, f->before);

    /* And a second uninstallation finds nothing to remove. */
    g_clear_pointer(&out, g_free);
    g_assert_cmpint(install(f, &out, TRUE), !=, 0);
    g_assert_nonnull(strstr(out, "no manifest"));
}

/* The staged unit passes systemd-analyze verify; its tmpfiles.d entry makes
 * /run/pagefold as it should. */
static void
test_staged_unit(Fixture *f, gconstpointer data)
{
    g_autofree char *check = NULL, *unit = NULL, *tmpfiles = NULL, *out = NULL, *run_dir = NULL;
    g_autofree char *tmpfiles_prog = NULL;
    struct stat st;
    int rc;

    if (skipped(f)) {
        return;
    }
    check = g_build_filename(env("PAGEFOLD_SOURCE_DIR"), "tests", "check-unit", NULL);
    unit = find_entry(f, "file", "/pagefoldd.service");
    {
        g_autofree char *p = at(f, unit);

        rc = run(&out, check, p, f->root, NULL);
    }
    if (rc == SKIP_STATUS) {
        g_test_skip(out);
        return;
    }
    g_test_message("%s", out);
    g_assert_cmpint(rc, ==, 0);

    tmpfiles_prog = g_find_program_in_path("systemd-tmpfiles");
    if (tmpfiles_prog == NULL || geteuid() != 0) {
        g_test_message("the tmpfiles.d entry is not applied: needs systemd-tmpfiles and root "
                       "(it makes /run/pagefold root's)");
        return;
    }
    tmpfiles = find_entry(f, "file", "tmpfiles.d/pagefold.conf");
    {
        /* --root= applies to what the entries name, not to the file given. */
        g_autofree char *rootarg = g_strdup_printf("--root=%s", f->root);
        g_autofree char *conf = at(f, tmpfiles);

        g_clear_pointer(&out, g_free);
        rc = run(&out, "systemd-tmpfiles", rootarg, "--create", conf, NULL);
    }
    g_test_message("systemd-tmpfiles --create %s: %s", tmpfiles, out);
    g_assert_cmpint(rc, ==, 0);
    run_dir = at(f, "run/pagefold");
    g_assert_cmpint(stat(run_dir, &st), ==, 0);
    g_assert_true(S_ISDIR(st.st_mode));
    g_assert_cmpint(st.st_mode & 07777, ==, 0755);
    g_assert_cmpint(st.st_uid, ==, 0);
    g_assert_cmpint(st.st_gid, ==, 0);
    /* Not the installation's: runtime state, gone with the staging tree. */
    g_assert_cmpint(g_rmdir(run_dir), ==, 0);
    {
        g_autofree char *run = at(f, "run");

        g_assert_cmpint(g_rmdir(run), ==, 0);
    }
}

/* The check fails on a unit systemd would not take as written. */
static void
test_unit_check_fails(Fixture *f, gconstpointer data)
{
    g_autofree char *check = NULL, *unit = NULL, *text = NULL, *bad = NULL, *out = NULL;
    g_autofree char *p = NULL;
    g_autoptr(GError) error = NULL;
    int rc;

    if (skipped(f)) {
        return;
    }
    check = g_build_filename(env("PAGEFOLD_SOURCE_DIR"), "tests", "check-unit", NULL);
    unit = find_entry(f, "file", "/pagefoldd.service");
    p = at(f, unit);
    g_file_get_contents(p, &text, NULL, &error);
    g_assert_no_error(error);
    bad = g_strconcat(text, "ProtectSytem=strict\n", NULL);
    g_file_set_contents(p, bad, -1, &error);
    g_assert_no_error(error);
    rc = run(&out, check, p, f->root, NULL);
    if (rc == SKIP_STATUS) {
        g_test_skip(out);
        return;
    }
    g_test_message("%s", out);
    g_assert_cmpint(rc, ==, 1);
    g_assert_nonnull(strstr(out, "ProtectSytem"));
}

/* The AppArmor rules compile where libvirt's QEMU and libvirtd get them,
 * and a broken rule does not. */
static void
test_staged_apparmor(Fixture *f, gconstpointer data)
{
    g_autofree char *check = NULL, *staged = NULL, *out = NULL, *text = NULL, *p = NULL;
    g_autoptr(GError) error = NULL;
    int rc;

    if (skipped(f)) {
        return;
    }
    check = g_build_filename(env("PAGEFOLD_SOURCE_DIR"), "tests", "check-apparmor", NULL);
    staged = at(f, "etc/apparmor.d");
    rc = run(&out, check, staged, NULL);
    if (rc == SKIP_STATUS) {
        g_test_skip(out);
        return;
    }
    g_test_message("%s", out);
    g_assert_cmpint(rc, ==, 0);

    p = at(f, "etc/apparmor.d/abstractions/pagefold-qemu");
    g_file_get_contents(p, &text, NULL, &error);
    g_assert_no_error(error);
    {
        g_autofree char *bad = g_strconcat(text, "  /run/pagefold/agent.sock rw\n", NULL);

        g_file_set_contents(p, bad, -1, &error);
        g_assert_no_error(error);
    }
    g_clear_pointer(&out, g_free);
    rc = run(&out, check, staged, NULL);
    g_test_message("%s", out);
    g_assert_cmpint(rc, ==, 1);
    g_assert_nonnull(strstr(out, "does not compile"));
}

int
main(int argc, char **argv)
{
    g_test_init(&argc, &argv, NULL);
    g_test_add("/install/tree", Fixture, NULL, setup, test_tree, teardown);
    g_test_add("/install/staged-unit", Fixture, NULL, setup, test_staged_unit, teardown);
    g_test_add("/install/unit-check-fails", Fixture, NULL, setup, test_unit_check_fails,
               teardown);
    g_test_add("/install/staged-apparmor", Fixture, NULL, setup, test_staged_apparmor, teardown);
    return g_test_run();
}
