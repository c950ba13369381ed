package flywheel;

import java.util.ArrayList;
import java.util.HashMap;
import java.util.List;
import java.util.Map;

import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.functions.AggregateFunction;
import org.apache.flink.types.Row;

/**
 * A user's long behavior history, condensed the moment it changes into fixed-size model inputs:
 * {@code long_history(item_id, category, event_type, event_time, capacity, categories, per_category,
 * emit_every)} in a GROUP BY of the user.
 *
 * <p>The state is a ring of the user's newest {@code capacity} behaviors (item, category and the strongest
 * action on it, in arrival order): bounded, and checkpointed with the job like any aggregate. A behavior is
 * an exposure or an action; an action that follows an exposure of the same item among the newest
 * {@code FOLLOW_UP} behaviors (a click on an impression) raises that behavior's type instead of adding one.
 *
 * <p>Each update emits, SIM-style (search by the candidate's category, done ahead of the request): how
 * many behaviors the ring holds; the user's {@code categories} most frequent categories in it (ties: the
 * most recent first) with their counts; and, for each of those, its newest {@code per_category} items and
 * their types, newest first, padded with "" to exactly {@code per_category} slots. What a request reads is
 * then fixed in size whatever the history's length.
 *
 * <p>The row changes (and the aggregate emits it: Flink sends no update for an unchanged result) on the
 * user's first behavior, on every action, and after {@code emit_every} exposures without one: an exposure
 * alone moves the model's inputs little, and a row per impression would carry the long lists downstream
 * for every event. The row's time is the newest event it includes.
 */
@FunctionHint(output = @DataTypeHint(
        "ROW<event_time BIGINT, history_length BIGINT, categories ARRAY<STRING>, counts ARRAY<BIGINT>, "
                + "items ARRAY<STRING>, types ARRAY<STRING>>"))
public class LongHistory extends AggregateFunction<Row, LongHistory.Ring> {

    /** Event types from the weakest to the strongest (streaming/events.py's EventType). */
    private static final List<String> STRENGTH = List.of("impression", "click", "add_to_cart", "purchase");
    /** How far back an action looks for the exposure it follows. */
    private static final int FOLLOW_UP = 64;

    /**
     * Slot {@code (start + i) % items.length} holds the i-th oldest of {@code size} behaviors. The arrays
     * grow (doubling) up to {@code capacity}: the state, and what Flink converts for each event, is the
     * size of the user's history, not of the setting.
     */
    public static class Ring {
        public int capacity = 0;
        public String[] items = new String[0];
        public String[] categories = new String[0];
        public String[] types = new String[0];
        public int start = 0;
        public int size = 0;
        public int topCategories = 0;
        public int perCategory = 0;
        public long newest = Long.MIN_VALUE;  // the newest event time seen
        public int pending = 0;  // exposures since the emitted row
        // The emitted row (its time MIN_VALUE before the first)
        public long rowTime = Long.MIN_VALUE;
        public long rowLength = 0;
        public String[] rowCategories = new String[0];
        public Long[] rowCounts = new Long[0];
        public String[] rowItems = new String[0];
        public String[] rowTypes = new String[0];
    }

    @Override
    public Ring createAccumulator() {
        return new Ring();
    }

    public void accumulate(Ring ring, String item, String category, String type, Long eventTime, Integer capacity,
                           Integer categories, Integer perCategory, Integer emitEvery) {
        if (item == null || type == null || eventTime == null) {
            return;
        }
        if (ring.items.length > capacity) {
            resize(ring, capacity);  // a smaller setting: the newest that fit
        }
        ring.capacity = capacity;
        ring.topCategories = categories;
        ring.perCategory = perCategory;
        ring.newest = Math.max(ring.newest, eventTime);
        add(ring, item, category == null ? "" : category, type);
        ring.pending++;
        if (ring.rowTime == Long.MIN_VALUE || strength(type) > 0 || ring.pending >= emitEvery) {
            condense(ring);
        }
    }

    private static int strength(String type) {
        int rank = STRENGTH.indexOf(type);
        return rank < 0 ? 1 : rank;  // a type this list does not know counts as an action
    }

    private static void add(Ring ring, String item, String category, String type) {
        int length = ring.items.length;
        for (int i = ring.size - 1; i >= Math.max(0, ring.size - FOLLOW_UP); i--) {
            int slot = (ring.start + i) % length;
            if (ring.items[slot].equals(item)) {
                if (strength(type) > strength(ring.types[slot])) {  // the action on that exposure
                    ring.types[slot] = type;
                    return;
                }
                break;  // a new exposure or action of an item already acted on: a behavior of its own
            }
        }
        if (ring.size == length && length < ring.capacity) {
            resize(ring, Math.min(ring.capacity, Math.max(8, 2 * length)));
            length = ring.items.length;
        }
        int slot = (ring.start + ring.size) % length;
        ring.items[slot] = item;
        ring.categories[slot] = category;
        ring.types[slot] = type;
        if (ring.size < length) {
            ring.size++;
        } else {
            ring.start = (ring.start + 1) % length;  // the oldest leaves
        }
    }

    /** New arrays of `length` with the newest behaviors that fit, oldest first. */
    private static void resize(Ring ring, int length) {
        Ring old = new Ring();
        old.items = ring.items;
        old.categories = ring.categories;
        old.types = ring.types;
        old.start = ring.start;
        old.size = ring.size;
        ring.items = new String[length];
        ring.categories = new String[length];
        ring.types = new String[length];
        ring.start = 0;
        ring.size = 0;
        for (int i = Math.max(0, old.size - length); i < old.size; i++) {
            int slot = (old.start + i) % old.items.length;
            add(ring, old.items[slot], old.categories[slot], old.types[slot]);
        }
    }

    /** For two-phase aggregation: a mini-batch's local ring holds newer behaviors than the global one. */
    public void merge(Ring ring, Iterable<Ring> others) {
        for (Ring other : others) {
            if (other.size == 0) {
                continue;
            }
            ring.topCategories = other.topCategories;
            ring.perCategory = other.perCategory;
            ring.capacity = other.capacity;
            for (int i = 0; i < other.size; i++) {
                int slot = (other.start + i) % other.items.length;
                add(ring, other.items[slot], other.categories[slot], other.types[slot]);
            }
            ring.newest = Math.max(ring.newest, other.newest);
        }
        condense(ring);
    }

    @Override
    public Row getValue(Ring ring) {
        return Row.of(ring.rowTime, ring.rowLength, ring.rowCategories, ring.rowCounts, ring.rowItems, ring.rowTypes);
    }

    /** The ring as the row to emit, kept in the ring until the next. */
    private static void condense(Ring ring) {
        // Per category (in order of first sight from the newest behavior back): count and newest items.
        Map<String, Integer> index = new HashMap<>();
        List<String> seen = new ArrayList<>();
        List<long[]> counts = new ArrayList<>();  // [count, recency rank of the newest behavior]
        List<List<Integer>> newest = new ArrayList<>();  // slots
        for (int i = ring.size - 1; i >= 0; i--) {
            int slot = (ring.start + i) % ring.items.length;
            String category = ring.categories[slot];
            Integer at = index.get(category);
            if (at == null) {
                at = seen.size();
                index.put(category, at);
                seen.add(category);
                counts.add(new long[] {0, ring.size - 1 - i});
                newest.add(new ArrayList<>());
            }
            counts.get(at)[0]++;
            if (newest.get(at).size() < ring.perCategory) {
                newest.get(at).add(slot);
            }
        }
        List<Integer> order = new ArrayList<>();
        for (int c = 0; c < seen.size(); c++) {
            order.add(c);
        }
        order.sort((a, b) -> counts.get(a)[0] != counts.get(b)[0]
                ? Long.compare(counts.get(b)[0], counts.get(a)[0])
                : Long.compare(counts.get(a)[1], counts.get(b)[1]));
        int kept = Math.min(ring.topCategories, order.size());
        String[] categories = new String[kept];
        Long[] categoryCounts = new Long[kept];
        String[] items = new String[kept * ring.perCategory];
        String[] types = new String[kept * ring.perCategory];
        for (int k = 0; k < kept; k++) {
            int c = order.get(k);
            categories[k] = seen.get(c);
            categoryCounts[k] = counts.get(c)[0];
            List<Integer> slots = newest.get(c);
            for (int j = 0; j < ring.perCategory; j++) {
                items[k * ring.perCategory + j] = j < slots.size() ? ring.items[slots.get(j)] : "";
                types[k * ring.perCategory + j] = j < slots.size() ? ring.types[slots.get(j)] : "";
            }
        }
        ring.rowTime = ring.newest;
        ring.rowLength = ring.size;
        ring.rowCategories = categories;
        ring.rowCounts = categoryCounts;
        ring.rowItems = items;
        ring.rowTypes = types;
        ring.pending = 0;
    }
}
