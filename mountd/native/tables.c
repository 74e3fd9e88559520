/* The native data plane's tables (plane_internal.h): the items by digest, each
 * digest's tree and its names, the datasets by inode range; what Python adds to them and
 * takes away. Every table is guarded by the plane's read-write lock. */
#define _GNU_SOURCE
#include "plane_internal.h"

/* ---- SipHash-2-4: names and digests come from users' digests, so the tables'
 * hashes are keyed (a chosen set of colliding names would slow every user). ---- */
#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))
#define SIPROUND                                                                    \
	do {                                                                        \
		v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);           \
		v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                              \
		v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                              \
		v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);           \
	} while (0)

static uint64_t siphash(const uint64_t key[2], uint64_t seed, const void *data, size_t len)
{
	const uint8_t *in = data;
	uint64_t v0 = 0x736f6d6570736575ULL ^ key[0], v1 = 0x646f72616e646f6dULL ^ key[1];
	uint64_t v2 = 0x6c7967656e657261ULL ^ key[0], v3 = 0x7465646279746573ULL ^ key[1];
	uint64_t m, b = ((uint64_t)len) << 56;
	v3 ^= seed; SIPROUND; SIPROUND; v0 ^= seed; /* the parent node, as a first word */
	size_t i;
	for (i = 0; i + 8 <= len; i += 8) {
		memcpy(&m, in + i, 8);
		v3 ^= m; SIPROUND; SIPROUND; v0 ^= m;
	}
	for (size_t j = 0; i + j < len; j++)
		b |= ((uint64_t)in[i + j]) << (8 * j);
	v3 ^= b; SIPROUND; SIPROUND; v0 ^= b;
	v2 ^= 0xff; SIPROUND; SIPROUND; SIPROUND; SIPROUND;
	return v0 ^ v1 ^ v2 ^ v3;
}

static uint64_t table_size(uint64_t n) /* a power of two at least twice n */
{
	uint64_t size = 16;
	while (size < 2 * n)
		size <<= 1;
	return size;
}

/* ---- slots and the digest table (under the write lock, or the read lock to look) ---- */
struct slot *slot_at(const struct plane *p, uint32_t i)
{
	return &p->blocks[i / SLOT_BLOCK][i % SLOT_BLOCK];
}

static uint64_t item_hash(const struct plane *p, const uint8_t *digest)
{
	return siphash(p->hash_key, 0, digest, PLANE_DIGEST);
}

/* The table position holding digest, or of the empty place where it would go. */
static uint64_t item_pos(const struct plane *p, const uint8_t *digest)
{
	uint64_t pos = item_hash(p, digest) & p->items_mask;
	while (p->items[pos] &&
	       memcmp(slot_at(p, p->items[pos] - 1)->digest, digest, PLANE_DIGEST))
		pos = (pos + 1) & p->items_mask;
	return pos;
}

static struct slot *item_find(const struct plane *p, const uint8_t *digest)
{
	if (!p->items)
		return NULL;
	uint32_t entry = p->items[item_pos(p, digest)];
	return entry ? slot_at(p, entry - 1) : NULL;
}

static int items_resize(struct plane *p, uint64_t size)
{
	uint32_t *old = p->items;
	uint64_t old_size = old ? p->items_mask + 1 : 0;
	uint32_t *items = calloc(size, sizeof *items);
	if (!items)
		return -ENOMEM;
	p->items = items;
	p->items_mask = size - 1;
	for (uint64_t i = 0; i < old_size; i++)
		if (old[i])
			p->items[item_pos(p, slot_at(p, old[i] - 1)->digest)] = old[i];
	free(old);
	return 0;
}

/* The slot of digest, made if new; UINT32_MAX where memory ran out. */
static uint32_t item_ref(struct plane *p, const uint8_t *digest)
{
	if (!p->items || 2 * (p->n_items + 1) > p->items_mask + 1)
		if (items_resize(p, table_size(p->n_items + 1)))
			return UINT32_MAX;
	uint64_t pos = item_pos(p, digest);
	if (p->items[pos]) {
		slot_at(p, p->items[pos] - 1)->refs++;
		return p->items[pos] - 1;
	}
	uint32_t i;
	if (p->n_free) {
		i = p->free_slots[--p->n_free];
	} else {
		if (p->n_slots == p->n_blocks * SLOT_BLOCK) {
			struct slot **blocks = realloc(p->blocks, (p->n_blocks + 1) * sizeof *blocks);
			if (!blocks)
				return UINT32_MAX;
			p->blocks = blocks;
			if (!(blocks[p->n_blocks] = calloc(SLOT_BLOCK, sizeof(struct slot))))
				return UINT32_MAX;
			p->n_blocks++;
		}
		i = p->n_slots++;
	}
	struct slot *s = slot_at(p, i);
	memcpy(s->digest, digest, PLANE_DIGEST);
	s->refs = 1;
	s->served = 0;
	s->condemned = 0;
	p->items[pos] = i + 1;
	p->n_items++;
	return i;
}

/* One reference to slot i fewer; a slot no entry names is forgotten (a READ still in
 * flight on it only counts itself off its inflight). */
void item_unref(struct plane *p, uint32_t i)
{
	struct slot *s = slot_at(p, i);
	if (--s->refs)
		return;
	uint64_t pos = item_pos(p, s->digest), next = pos;
	p->items[pos] = 0; /* backward-shift deletion keeps every probe sequence whole */
	for (;;) {
		next = (next + 1) & p->items_mask;
		if (!p->items[next])
			break;
		uint64_t home = item_hash(p, slot_at(p, p->items[next] - 1)->digest) & p->items_mask;
		if (((next - home) & p->items_mask) >= ((next - pos) & p->items_mask)) {
			p->items[pos] = p->items[next];
			p->items[next] = 0;
			pos = next;
		}
	}
	p->n_items--;
	s->served = 0;
	pthread_mutex_lock(&p->backing_lock);
	backing_drop(p, s, 1);
	pthread_mutex_unlock(&p->backing_lock);
	if (p->n_free == p->cap_free) {
		size_t cap = p->cap_free ? 2 * p->cap_free : 1024;
		uint32_t *free_slots = realloc(p->free_slots, cap * sizeof *free_slots);
		if (!free_slots)
			return; /* the slot is lost to reuse, not to correctness */
		p->free_slots = free_slots;
		p->cap_free = cap;
	}
	p->free_slots[p->n_free++] = i;
}

/* ---- datasets ---- */
static size_t dataset_pos(const struct plane *p, uint64_t inode) /* first base > inode */
{
	size_t lo = 0, hi = p->n_datasets;
	while (lo < hi) {
		size_t mid = (lo + hi) / 2;
		if (p->datasets[mid]->base <= inode)
			lo = mid + 1;
		else
			hi = mid;
	}
	return lo;
}

struct dataset *dataset_of(const struct plane *p, uint64_t inode, uint32_t *node)
{
	size_t pos = dataset_pos(p, inode);
	if (!pos)
		return NULL;
	struct dataset *ds = p->datasets[pos - 1];
	uint64_t local = inode - ds->base;
	if (local >= (uint64_t)ds->t->n_dirs + ds->t->n_files)
		return NULL;
	*node = (uint32_t)local;
	return ds;
}

static const char *node_name(const struct tree *t, uint32_t node, size_t *len)
{
	uint32_t start = node ? t->name_ends[node - 1] : 0;
	*len = t->name_ends[node] - start;
	return t->names + start;
}

static uint64_t name_hash(const struct plane *p, uint32_t parent, const char *name, size_t len)
{
	return siphash(p->hash_key, parent, name, len);
}

uint32_t tree_lookup(const struct plane *p, const struct tree *t, uint32_t parent,
			    const char *name, size_t len)
{
	uint64_t pos = name_hash(p, parent, name, len) & t->ht_mask;
	for (uint32_t entry; (entry = t->names_ht[pos]); pos = (pos + 1) & t->ht_mask) {
		size_t found_len;
		const char *found = node_name(t, entry - 1, &found_len);
		if (t->parents[entry - 1] == parent && found_len == len &&
		    !memcmp(found, name, len))
			return entry - 1;
	}
	return 0; /* node 0 is no one's child */
}

void tree_free(struct tree *t)
{
	if (!t)
		return;
	free(t->parents);
	free(t->name_ends);
	free(t->slots);
	free(t->names);
	free(t->sizes);
	free(t->names_ht);
	free(t);
}

static struct tree *tree_of(const struct plane *p, const uint8_t *identity)
{
	for (size_t i = 0; i < p->n_trees; i++)
		if (!memcmp(p->trees[i]->identity, identity, PLANE_DIGEST))
			return p->trees[i];
	return NULL;
}

/* A tree's entries' slots are taken and given back in batches, so that readers wait
 * for one batch at most. */
#define REF_BATCH 4096

static void tree_unref_slots(struct plane *p, struct tree *t, uint32_t n)
{
	for (uint32_t done = 0; done < n;) {
		pthread_rwlock_wrlock(&p->lock);
		for (uint32_t end = done + REF_BATCH < n ? done + REF_BATCH : n; done < end; done++)
			item_unref(p, t->slots[done]);
		pthread_rwlock_unlock(&p->lock);
	}
}

/* A new tree, built outside the lock and its slots taken; NULL with *error set. */
static struct tree *tree_new(struct plane *p, const uint8_t *identity,
			     const struct plane_tree *in, int *error)
{
	uint32_t n_dirs = in->n_dirs, n_files = in->n_files;
	uint64_t n_nodes = (uint64_t)n_dirs + n_files;
	*error = -EINVAL;
	if (!n_dirs || n_nodes > UINT32_MAX - 1 || in->name_ends[0] != 0)
		return NULL;
	for (uint64_t node = 1; node < n_nodes; node++) {
		if (in->name_ends[node] <= in->name_ends[node - 1] || in->parents[node] >= n_dirs)
			return NULL; /* every node but the root named, in a directory */
	}
	*error = -ENOMEM;
	struct tree *t = calloc(1, sizeof *t);
	if (!t)
		return NULL;
	size_t names_len = in->name_ends[n_nodes - 1];
	memcpy(t->identity, identity, PLANE_DIGEST);
	t->n_dirs = n_dirs;
	t->n_files = n_files;
	t->parents = malloc(n_nodes * sizeof *t->parents);
	t->name_ends = malloc(n_nodes * sizeof *t->name_ends);
	t->names = malloc(names_len + 1);
	t->sizes = malloc((n_files + 1) * sizeof *t->sizes);
	t->slots = malloc((n_files + 1) * sizeof *t->slots);
	uint64_t ht_size = table_size(n_nodes);
	t->names_ht = calloc(ht_size, sizeof *t->names_ht);
	t->ht_mask = ht_size - 1;
	if (!t->parents || !t->name_ends || !t->names || !t->sizes || !t->slots ||
	    !t->names_ht) {
		tree_free(t);
		return NULL;
	}
	memcpy(t->parents, in->parents, n_nodes * sizeof *t->parents);
	memcpy(t->name_ends, in->name_ends, n_nodes * sizeof *t->name_ends);
	memcpy(t->names, in->names, names_len);
	memcpy(t->sizes, in->sizes, n_files * sizeof *t->sizes);
	for (uint32_t node = 1; node < n_nodes; node++) {
		size_t len;
		const char *name = node_name(t, node, &len);
		if (tree_lookup(p, t, t->parents[node], name, len)) {
			tree_free(t); /* two entries of one name in a directory */
			*error = -EINVAL;
			return NULL;
		}
		uint64_t pos = name_hash(p, t->parents[node], name, len) & t->ht_mask;
		while (t->names_ht[pos])
			pos = (pos + 1) & t->ht_mask;
		t->names_ht[pos] = node + 1;
	}
	uint32_t done = 0;
	int full = 0;
	while (done < n_files && !full) {
		pthread_rwlock_wrlock(&p->lock);
		for (uint32_t end = done + REF_BATCH < n_files ? done + REF_BATCH : n_files;
		     done < end && !full; done++) {
			t->slots[done] = item_ref(p, in->digests + (size_t)done * PLANE_DIGEST);
			full = t->slots[done] == UINT32_MAX;
		}
		pthread_rwlock_unlock(&p->lock);
	}
	if (full) { /* out of memory: the slots taken go back */
		tree_unref_slots(p, t, done - 1);
		tree_free(t);
		return NULL;
	}
	*error = 0;
	return t;
}

int plane_has_tree(struct plane *p, const uint8_t *identity)
{
	pthread_rwlock_rdlock(&p->lock);
	int found = tree_of(p, identity) != NULL;
	pthread_rwlock_unlock(&p->lock);
	return found;
}

/* Under the write lock: room for one more in an array of pointers. */
static int room(void ***items, size_t n, size_t *cap)
{
	if (n < *cap)
		return 0;
	size_t more = *cap ? 2 * *cap : 16;
	void **grown = realloc(*items, more * sizeof *grown);
	if (!grown)
		return -ENOMEM;
	*items = grown;
	*cap = more;
	return 0;
}

int plane_add_dataset(struct plane *p, uint64_t base, const uint8_t *identity, uint32_t uid,
		      uint32_t gid, int64_t time_ns, const struct plane_tree *tree,
		      const uint32_t *pools, uint32_t n_pools)
{
	struct dataset *ds = calloc(1, sizeof *ds);
	if (!ds)
		return -ENOMEM;
	if (pools) {
		ds->pools = malloc((n_pools ? n_pools : 1) * sizeof *ds->pools);
		if (!ds->pools) {
			free(ds);
			return -ENOMEM;
		}
		memcpy(ds->pools, pools, n_pools * sizeof *pools);
		for (uint32_t i = 0; i < n_pools; i++)
			if (pools[i] >= ds->n_pools)
				ds->n_pools = pools[i] + 1;
	}
	ds->base = base;
	ds->uid = uid;
	ds->gid = gid;
	ds->time_ns = time_ns;
	struct tree *made = NULL;
	int error = 0;
	pthread_rwlock_rdlock(&p->lock);
	int shared = tree_of(p, identity) != NULL;
	pthread_rwlock_unlock(&p->lock);
	if (!shared) { /* the caller adds and removes datasets one at a time */
		if (!tree)
			error = -ENOENT;
		else
			made = tree_new(p, identity, tree, &error);
	}
	pthread_rwlock_wrlock(&p->lock);
	struct tree *t = error ? NULL : made ? made : tree_of(p, identity);
	if (!error && !t)
		error = -ENOENT;
	if (!error && (base > UINT64_MAX - ((uint64_t)t->n_dirs + t->n_files) ||
		       (pools && n_pools != t->n_files)))
		error = -EINVAL;
	size_t pos = dataset_pos(p, base);
	if (!error) {
		uint64_t end = base + t->n_dirs + t->n_files;
		const struct dataset *before = pos ? p->datasets[pos - 1] : NULL;
		if ((before && before->base + before->t->n_dirs + before->t->n_files > base) ||
		    (pos < p->n_datasets && p->datasets[pos]->base < end))
			error = -EEXIST;
	}
	if (!error)
		error = room((void ***)&p->datasets, p->n_datasets, &p->cap_datasets);
	if (!error && made)
		error = room((void ***)&p->trees, p->n_trees, &p->cap_trees);
	if (!error) {
		if (made)
			p->trees[p->n_trees++] = made;
		ds->t = t;
		t->refs++;
		memmove(p->datasets + pos + 1, p->datasets + pos,
			(p->n_datasets - pos) * sizeof *p->datasets);
		p->datasets[pos] = ds;
		p->n_datasets++;
	}
	pthread_rwlock_unlock(&p->lock);
	if (error) {
		if (made) {
			tree_unref_slots(p, made, made->n_files);
			tree_free(made);
		}
		free(ds->pools);
		free(ds);
	}
	return error;
}

int plane_remove_dataset(struct plane *p, uint64_t base)
{
	pthread_rwlock_wrlock(&p->lock);
	size_t pos = dataset_pos(p, base);
	if (!pos || p->datasets[pos - 1]->base != base) {
		pthread_rwlock_unlock(&p->lock);
		return -ENOENT;
	}
	struct dataset *ds = p->datasets[pos - 1];
	memmove(p->datasets + pos - 1, p->datasets + pos,
		(p->n_datasets - pos) * sizeof *p->datasets);
	p->n_datasets--;
	struct tree *t = ds->t;
	if (--t->refs) {
		t = NULL; /* other datasets share it */
	} else {
		for (size_t i = 0; i < p->n_trees; i++)
			if (p->trees[i] == t) {
				p->trees[i] = p->trees[--p->n_trees];
				break;
			}
	}
	pthread_rwlock_unlock(&p->lock);
	if (t) {
		tree_unref_slots(p, t, t->n_files);
		tree_free(t);
	}
	free(ds->pools);
	free(ds);
	return 0;
}

int plane_suspend_dataset(struct plane *p, uint64_t base, int suspended)
{
	pthread_rwlock_wrlock(&p->lock);
	size_t pos = dataset_pos(p, base);
	int found = pos && p->datasets[pos - 1]->base == base;
	if (found)
		p->datasets[pos - 1]->suspended = suspended;
	pthread_rwlock_unlock(&p->lock);
	return found ? 0 : -ENOENT;
}

int plane_serve(struct plane *p, const uint8_t *digest, const char *name)
{
	for (int i = 0; i < PLANE_NAME; i++)
		if (!strchr("0123456789abcdef", name[i]) || !name[i])
			return -EINVAL;
	pthread_rwlock_wrlock(&p->lock);
	struct slot *s = item_find(p, digest);
	if (s) {
		if (memcmp(s->name, name, PLANE_NAME)) { /* another file: new opens use it */
			pthread_mutex_lock(&p->backing_lock);
			backing_drop(p, s, 0);
			pthread_mutex_unlock(&p->backing_lock);
		}
		memcpy(s->name, name, PLANE_NAME);
		s->served = 1;
		s->condemned = 0;
	}
	pthread_rwlock_unlock(&p->lock);
	return s != NULL;
}

void plane_withdraw(struct plane *p, const uint8_t *digest, int wait)
{
	pthread_rwlock_wrlock(&p->lock);
	uint64_t pos = p->items ? item_pos(p, digest) : 0;
	uint32_t entry = p->items ? p->items[pos] : 0;
	struct slot *s = entry ? slot_at(p, entry - 1) : NULL;
	if (s) {
		s->served = 0;
		s->condemned |= (uint8_t)(wait != 0);
		pthread_mutex_lock(&p->backing_lock);
		backing_drop(p, s, 0);
		pthread_mutex_unlock(&p->backing_lock);
	}
	pthread_rwlock_unlock(&p->lock);
	/* READs that found it served before are counted in inflight; none starts now. */
	while (wait && s && atomic_load(&s->inflight)) {
		struct timespec pause = {0, 50 * 1000};
		nanosleep(&pause, NULL);
	}
}
