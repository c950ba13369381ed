package flywheel;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.HashSet;
import java.util.List;
import java.util.Map;
import java.util.Set;

import org.apache.flink.table.annotation.DataTypeHint;
import org.apache.flink.table.annotation.FunctionHint;
import org.apache.flink.table.data.GenericArrayData;
import org.apache.flink.table.data.GenericRowData;
import org.apache.flink.table.data.RowData;
import org.apache.flink.table.data.StringData;
import org.apache.flink.table.functions.AggregateFunction;
import org.apache.flink.table.functions.FunctionContext;
import org.apache.flink.table.runtime.typeutils.RowDataSerializer;
import org.apache.flink.table.types.logical.ArrayType;
import org.apache.flink.table.types.logical.BigIntType;
import org.apache.flink.table.types.logical.VarCharType;

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
 *
 * <p>Cost per event, whatever the history's length: the accumulator is a RAW value (Flink keeps the Java
 * object in its heap state and serializes it, with {@link RingSerializer}, only at checkpoints; a
 * structured accumulator was converted to and from Flink's rows on every event, at the cost of the whole
 * ring); categories and types are codes; counts per category and a link from each behavior to the previous
 * one of its category are kept as behaviors come and go, so condensing walks the top categories' newest
 * items, not the ring; and the emitted row is built once per change, in Flink's own format, and handed out
 * as it is (the aggregate asks for its value twice per event to compare).
 */
@FunctionHint(
        accumulator = @DataTypeHint(value = "RAW", bridgedTo = LongHistory.Ring.class,
                rawSerializer = RingSerializer.class),
        output = @DataTypeHint(value = "ROW<event_time BIGINT, history_length BIGINT, categories ARRAY<STRING>, "
                + "counts ARRAY<BIGINT>, items ARRAY<STRING>, types ARRAY<STRING>>", bridgedTo = RowData.class))
public class LongHistory extends AggregateFunction<RowData, LongHistory.Ring> {

    /** Job parameter: the dataset spec's exposure types, '|'-separated (the rest are actions). */
    static final String EXPOSURE_TYPES = "flywheel.exposure-types";
    /** Each declared type's rank, from the weakest to the strongest (the spec's order). */
    private Map<String, Integer> rank;
    private Set<String> exposures;
    /** How far back an action looks for the exposure it follows. */
    static final int FOLLOW_UP = 64;
    /** The emitted row's layout, to build it in Flink's binary format (one per task thread). */
    private static final ThreadLocal<RowDataSerializer> ROW = ThreadLocal.withInitial(() -> new RowDataSerializer(
            new BigIntType(), new BigIntType(), new ArrayType(new VarCharType(VarCharType.MAX_LENGTH)),
            new ArrayType(new BigIntType()), new ArrayType(new VarCharType(VarCharType.MAX_LENGTH)),
            new ArrayType(new VarCharType(VarCharType.MAX_LENGTH))));

    /**
     * Behaviors are numbered in arrival order; behavior {@code n} (for {@code first <= n < next}) sits in slot
     * {@code n % items.length}. The arrays grow (doubling) up to {@code capacity}: the state is the size of
     * the user's history, not of the setting. Categories and types are codes into {@code names}.
     */
    public static class Ring {
        int capacity = 0;
        int topCategories = 0;
        int perCategory = 0;
        long first = 0;
        long next = 0;
        String[] items = new String[0];
        int[] categories = new int[0];
        int[] types = new int[0];
        long[] previous = new long[0];  // the number of the previous behavior of the same category (-1: none)
        final List<String> names = new ArrayList<>();
        final Map<String, Integer> codes = new HashMap<>();
        int[] counts = new int[0];  // by code: behaviors of that category kept
        long[] newestOf = new long[0];  // by code: the number of its newest behavior (-1: none)
        long newest = Long.MIN_VALUE;  // the newest event time seen
        int pending = 0;  // exposures since the emitted row
        // The emitted row (its time MIN_VALUE before the first) and, built from it when asked, Flink's form
        long rowTime = Long.MIN_VALUE;
        long rowLength = 0;
        String[] rowCategories = new String[0];
        long[] rowCounts = new long[0];
        String[] rowItems = new String[0];
        String[] rowTypes = new String[0];
        RowData row;

        int size() {
            return (int) (next - first);
        }

        int slot(long n) {
            return (int) (n % items.length);
        }

        int code(String name) {
            Integer code = codes.get(name);
            if (code == null) {
                code = names.size();
                names.add(name);
                codes.put(name, code);
                if (code >= counts.length) {
                    counts = Arrays.copyOf(counts, Math.max(8, 2 * counts.length));
                    newestOf = Arrays.copyOf(newestOf, counts.length);
                    Arrays.fill(newestOf, code, newestOf.length, -1L);
                }
            }
            return code;
        }

        /** Names no kept behavior uses are dropped (categories that left the ring): codes stay few. */
        void compact() {
            int[] remap = new int[names.size()];
            Arrays.fill(remap, -1);
            List<String> kept = new ArrayList<>();
            for (long n = first; n < next; n++) {
                int s = slot(n);
                for (int c : new int[] {categories[s], types[s]}) {
                    if (remap[c] < 0) {
                        remap[c] = kept.size();
                        kept.add(names.get(c));
                    }
                }
            }
            int[] newCounts = new int[Math.max(8, kept.size())];
            long[] newNewest = new long[newCounts.length];
            Arrays.fill(newNewest, -1L);
            for (int c = 0; c < remap.length; c++) {
                if (remap[c] >= 0) {
                    newCounts[remap[c]] = counts[c];
                    newNewest[remap[c]] = newestOf[c];
                }
            }
            for (long n = first; n < next; n++) {
                int s = slot(n);
                categories[s] = remap[categories[s]];
                types[s] = remap[types[s]];
            }
            names.clear();
            names.addAll(kept);
            codes.clear();
            for (int c = 0; c < kept.size(); c++) {
                codes.put(kept.get(c), c);
            }
            counts = newCounts;
            newestOf = newNewest;
        }
    }

    @Override
    public void open(FunctionContext context) {
        List<String> types = ParseEvent.jobList(context, ParseEvent.EVENT_TYPES);
        rank = new HashMap<>();
        for (int i = 0; i < types.size(); i++) {
            rank.put(types.get(i), i);
        }
        exposures = new HashSet<>(ParseEvent.jobList(context, EXPOSURE_TYPES));
    }

    @Override
    public Ring createAccumulator() {
        return new Ring();
    }

    public void accumulate(Ring ring, String item, String category, String type, Long eventTime, Integer capacity,
                           Integer categories, Integer perCategory, Integer emitEvery) {
        if (item == null || type == null || eventTime == null || capacity == null || capacity < 1) {
            return;
        }
        ring.capacity = capacity;
        while (ring.size() > capacity) {
            evictOldest(ring);  // a smaller setting: the newest that fit
        }
        if (ring.items.length > capacity) {
            resize(ring, capacity);
        }
        ring.topCategories = categories;
        ring.perCategory = perCategory;
        ring.newest = Math.max(ring.newest, eventTime);
        add(ring, item, category == null ? "" : category, type);
        ring.pending++;
        if (ring.rowTime == Long.MIN_VALUE || !exposures.contains(type) || ring.pending >= emitEvery) {
            condense(ring);
        }
    }

    int strength(String type) {
        return rank.getOrDefault(type, 0);  // every type the parser passes is declared
    }

    void add(Ring ring, String item, String category, String type) {
        if (ring.names.size() >= 2 * ring.capacity + 16) {
            ring.compact();  // before any code is taken: compacting renumbers them
        }
        for (long n = ring.next - 1; n >= Math.max(ring.first, ring.next - FOLLOW_UP); n--) {
            int slot = ring.slot(n);
            if (ring.items[slot].equals(item)) {
                if (strength(type) > strength(ring.names.get(ring.types[slot]))) {  // the action on that exposure
                    ring.types[slot] = ring.code(type);
                    return;
                }
                break;  // a new exposure or action of an item already acted on: a behavior of its own
            }
        }
        int c = ring.code(category);
        int t = ring.code(type);
        if (ring.size() == ring.items.length) {
            if (ring.items.length < ring.capacity) {
                resize(ring, Math.min(ring.capacity, Math.max(8, 2 * ring.items.length)));
            } else {
                evictOldest(ring);
            }
        }
        int slot = ring.slot(ring.next);
        ring.items[slot] = item;
        ring.categories[slot] = c;
        ring.types[slot] = t;
        ring.previous[slot] = ring.newestOf[c];
        ring.newestOf[c] = ring.next;
        ring.counts[c]++;
        ring.next++;
    }

    private static void evictOldest(Ring ring) {
        int slot = ring.slot(ring.first);
        int c = ring.categories[slot];
        if (--ring.counts[c] == 0) {
            ring.newestOf[c] = -1;
        }
        ring.items[slot] = null;
        ring.first++;
    }

    /** New arrays of `length` (at least the ring's size), each behavior in its slot there. */
    private static void resize(Ring ring, int length) {
        String[] items = new String[length];
        int[] categories = new int[length];
        int[] types = new int[length];
        long[] previous = new long[length];
        for (long n = ring.first; n < ring.next; n++) {
            int from = ring.slot(n);
            int to = (int) (n % length);
            items[to] = ring.items[from];
            categories[to] = ring.categories[from];
            types[to] = ring.types[from];
            previous[to] = ring.previous[from];
        }
        ring.items = items;
        ring.categories = categories;
        ring.types = types;
        ring.previous = previous;
    }

    /** For two-phase aggregation: a mini-batch's local ring holds newer behaviors than the global one. */
    public void merge(Ring ring, Iterable<Ring> others) {
        for (Ring other : others) {
            if (other.size() == 0) {
                continue;
            }
            ring.topCategories = other.topCategories;
            ring.perCategory = other.perCategory;
            ring.capacity = other.capacity;
            while (ring.size() > ring.capacity) {
                evictOldest(ring);
            }
            for (long n = other.first; n < other.next; n++) {
                int slot = other.slot(n);
                add(ring, other.items[slot], other.names.get(other.categories[slot]),
                    other.names.get(other.types[slot]));
            }
            ring.newest = Math.max(ring.newest, other.newest);
        }
        condense(ring);
    }

    @Override
    public RowData getValue(Ring ring) {
        if (ring.row == null) {
            ring.row = ROW.get().toBinaryRow(GenericRowData.of(ring.rowTime, ring.rowLength,
                    strings(ring.rowCategories), new GenericArrayData(ring.rowCounts), strings(ring.rowItems),
                    strings(ring.rowTypes))).copy();
        }
        return ring.row;
    }

    private static GenericArrayData strings(String[] values) {
        StringData[] out = new StringData[values.length];
        for (int i = 0; i < values.length; i++) {
            out[i] = StringData.fromString(values[i]);
        }
        return new GenericArrayData(out);
    }

    /** The ring as the row to emit, kept in the ring until the next. */
    static void condense(Ring ring) {
        List<Integer> present = new ArrayList<>();
        for (int c = 0; c < ring.names.size(); c++) {
            if (ring.counts[c] > 0) {
                present.add(c);
            }
        }
        // the most frequent first; ties: the one with the most recent behavior
        present.sort((a, b) -> ring.counts[a] != ring.counts[b] ? Integer.compare(ring.counts[b], ring.counts[a])
                : Long.compare(ring.newestOf[b], ring.newestOf[a]));
        int kept = Math.min(ring.topCategories, present.size());
        int per = ring.perCategory;
        String[] categories = new String[kept];
        long[] counts = new long[kept];
        String[] items = new String[kept * per];
        String[] types = new String[kept * per];
        Arrays.fill(items, "");
        Arrays.fill(types, "");
        for (int k = 0; k < kept; k++) {
            int c = present.get(k);
            categories[k] = ring.names.get(c);
            counts[k] = ring.counts[c];
            long n = ring.newestOf[c];
            for (int j = 0; j < per && n >= ring.first; j++) {
                int slot = ring.slot(n);
                items[k * per + j] = ring.items[slot];
                types[k * per + j] = ring.names.get(ring.types[slot]);
                n = ring.previous[slot];
            }
        }
        ring.rowTime = ring.newest;
        ring.rowLength = ring.size();
        ring.rowCategories = categories;
        ring.rowCounts = counts;
        ring.rowItems = items;
        ring.rowTypes = types;
        ring.row = null;
        ring.pending = 0;
    }
}
